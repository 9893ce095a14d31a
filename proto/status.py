"""Heartbeats: what each service reports to the controller, several times a minute.

Writers: each rollout worker (`WorkerStatus`) and the learner (`LearnerStatus`), into Redis. Readers: the
controller's status API, the web page, and the Prometheus exporter. A status older than a few heartbeat
periods means the service is gone.
"""

from typing import Literal

from pydantic import Field

from sparkrl.proto.base import WireModel

STATUS_SCHEMA_VERSION = 1


class WorkerStatus(WireModel):
    """One rollout worker's heartbeat. Writer: rollout worker. Readers: controller, dashboards."""

    schema_version: Literal[1] = Field(
        default=STATUS_SCHEMA_VERSION, description="Wire version; readers reject others."
    )
    worker_id: str = Field(
        min_length=1,
        max_length=128,
        description="The worker's id, the same as `TrajectoryGroup.producer`. Writer: rollout worker. "
        "Readers: controller, learner (broadcast group membership).",
    )
    engine: Literal["torch", "vllm"] = Field(
        description="Generation engine: `vllm` on GPU, `torch` on CPU. Writer: rollout worker. Reader: "
        "controller."
    )
    state: Literal["starting", "generating", "syncing", "paused", "stopping"] = Field(
        description="`syncing`: receiving weights. Writer: rollout worker. Reader: controller."
    )
    policy_version: int | None = Field(
        default=None,
        ge=0,
        description="Policy version of the weights it holds. Writer: rollout worker. Readers: controller, "
        "sync monitor (versions behind the learner). None until weights are loaded.",
    )
    weights_checksum: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="Checksum of the weights it holds, as in `WeightAnnouncement.checksum`. Writer: "
        "rollout worker. Reader: sync monitor (flags a mismatch). None when not computed (initial "
        "weights).",
    )
    tokens_per_s: float = Field(
        ge=0,
        description="Generated tokens per second over the last heartbeat period. Writer: rollout worker. "
        "Readers: controller, Prometheus.",
    )
    groups_published: int = Field(
        ge=0,
        description="Groups published since start. Writer: rollout worker. Readers: controller, Prometheus.",
    )
    prompts_in_flight: int = Field(
        ge=0,
        description="Prompts taken from the stream and not yet published. Writer: rollout worker. Reader: "
        "controller.",
    )
    queue_lag: int | None = Field(
        default=None,
        ge=0,
        description="Entries of the prompt stream not yet delivered to any worker. Writer: rollout worker. "
        "Readers: controller, Prometheus. None when the bus cannot tell.",
    )
    last_sync_seconds: float | None = Field(
        default=None,
        ge=0,
        description="Wall time of its last weight sync (announcement seen → weights loaded), seconds. "
        "Writer: rollout worker. Reader: sync monitor. None before the first sync.",
    )
    heartbeat_at: float = Field(
        ge=0,
        description="Unix time (s) of this report. Writer: rollout worker. Reader: controller (liveness).",
    )


class LearnerStatus(WireModel):
    """The learner's heartbeat. Writer: learner. Readers: controller, dashboards."""

    schema_version: Literal[1] = Field(
        default=STATUS_SCHEMA_VERSION, description="Wire version; readers reject others."
    )
    step: int = Field(
        ge=0, description="Optimizer steps taken. Writer: learner. Readers: controller, Prometheus."
    )
    policy_version: int = Field(
        ge=0,
        description="Version of the weights last broadcast. Writer: learner. Readers: controller, sync "
        "monitor (compares with each worker's).",
    )
    state: Literal["starting", "training", "paused", "checkpointing", "stopping", "stopped"] = Field(
        description="Lifecycle state. Writer: learner. Reader: controller."
    )
    groups_trained: int = Field(
        ge=0,
        description="Trajectory groups trained on since start. Writer: learner. Readers: controller, "
        "Prometheus.",
    )
    last_loss: float | None = Field(
        default=None,
        description="Loss of the last step. Writer: learner. Readers: controller, dashboards. None before "
        "the first step, or when the loss was not finite (the learner logs that as an error).",
    )
    last_sync_seconds: float | None = Field(
        default=None,
        ge=0,
        description="Wall time of the last weight broadcast (announce → all ranks done), seconds. Writer: "
        "learner. Reader: sync monitor. None before the first broadcast.",
    )
    group_epoch: int = Field(
        ge=0,
        description="Generation of the broadcast process group, as in `WeightAnnouncement.group_epoch`. "
        "Writer: learner. Reader: sync monitor.",
    )
    members: list[str] = Field(
        default_factory=list,
        description="Worker ids in the current broadcast group, in rank order (rank 1 first). Writer: "
        "learner. Reader: sync monitor.",
    )
    heartbeat_at: float = Field(
        ge=0, description="Unix time (s) of this report. Writer: learner. Reader: controller (liveness)."
    )
