"""The `ray` section of the settings: where `sparkrl up --ray` runs and what each part asks Ray for.

Only the launcher reads it (no service does): the learner and every rollout worker become Ray actors
with these resource requests, the reward service a Ray Serve deployment with these replicas.
"""

from __future__ import annotations

from pydantic import Field

from sparkrl.services.common.settings.section import Section


class ActorResources(Section):
    """What one actor asks Ray for, and how often Ray restarts it when its process dies."""

    num_cpus: float = Field(1.0, ge=0, description="CPUs the actor reserves (fractions allowed).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs the actor reserves (fractions allowed).")
    max_restarts: int = Field(
        -1, ge=-1, description="Restarts of the actor when its process dies; -1: without limit."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources the actor reserves, e.g. {rollout: 1}: it is placed only on nodes "
        "that offer them (`ray start --resources '{\"rollout\": 1}'`), and a node offering 1 holds one "
        "such actor. Empty: any node with the CPUs and GPUs.",
    )


class ServeAutoscaling(Section):
    """Ray Serve's autoscaling of the reward service (its `autoscaling_config`)."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas.")
    max_replicas: int = Field(4, ge=1, description="Most replicas.")
    target_ongoing_requests: float = Field(
        4.0, gt=0, description="Requests in flight per replica Serve scales towards."
    )


class ServeSettings(Section):
    """The reward service as a Ray Serve deployment behind Serve's HTTP proxy on reward.host:reward.port."""

    num_replicas: int = Field(1, ge=1, description="Replicas when autoscaling is off.")
    autoscaling: ServeAutoscaling | None = Field(None, description="Scale the replicas with the load.")
    num_cpus: float = Field(
        1.0, ge=0, description="CPUs each replica reserves (its verifier processes run beside it)."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each replica reserves (see ray.learner.resources). Serve's HTTP "
        "proxy runs on the head node whatever this says.",
    )


class RaySettings(Section):
    """`sparkrl up --ray`: the learner and the workers as actors, the reward service on Ray Serve."""

    address: str | None = Field(
        None, description="Ray cluster to join (`ray://…` or `auto`); None: start a local Ray for the run."
    )
    num_cpus: int | None = Field(
        None,
        ge=1,
        description="CPUs of a local Ray started for the run; None: the machine's. Leave unset when joining "
        "a cluster (Ray refuses resource counts then).",
    )
    learner: ActorResources = Field(default_factory=ActorResources, description="The learner actor.")
    rollout: ActorResources = Field(default_factory=ActorResources, description="Each rollout worker actor.")
    reward: ServeSettings = Field(default_factory=ServeSettings, description="The reward deployment.")
