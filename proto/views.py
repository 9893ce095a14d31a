"""What the control service's REST API answers: views over the telemetry, and command outcomes.

Writer: the control service (built from the statuses and streams of `telemetry.py`). Readers: the web
page, `sparkrl status` and the other CLI clients, and any script. The OpenAPI document names them.
"""

from typing import Literal

from pydantic import Field

from sparkrl.proto.base import WireModel
from sparkrl.proto.control import HparamValue
from sparkrl.proto.names import CheckpointTag
from sparkrl.proto.reward import JudgeUsage
from sparkrl.proto.status import EpisodeTally, LearnerStatus
from sparkrl.proto.telemetry import CommandResult, EvalRecord, StepMetrics, SyncEvent

LearnerState = Literal["starting", "training", "paused", "checkpointing", "stopping", "stopped", "unknown"]


class StatusView(WireModel):
    """`GET /api/v1/status`: the learner and the fleet in one look."""

    state: LearnerState = Field(
        description="The learner's state; `unknown` when no learner heartbeat is live (not started, "
        "restarting, or gone)."
    )
    learner_alive: bool = Field(description="Whether a learner heartbeat is live.")
    heartbeat_age_s: float | None = Field(
        default=None, ge=0, description="Seconds since the learner's last heartbeat; None without one."
    )
    step: int = Field(ge=0, description="Optimizer steps taken (0 without a learner).")
    max_steps: int | None = Field(default=None, ge=1, description="Where the run ends; None: until stopped.")
    policy_version: int = Field(ge=0, description="The learner's policy version.")
    last_loss: float | None = Field(default=None, description="Loss of the last step.")
    last_reward: float | None = Field(default=None, description="Mean reward of the last step.")
    last_entropy: float | None = Field(default=None, description="Token entropy of the last step.")
    tokens_per_s: float | None = Field(default=None, ge=0, description="Tokens trained per second (learner).")
    generation_tokens_per_s: float = Field(
        ge=0, description="Tokens generated per second, summed over the live workers."
    )
    groups_trained: int = Field(ge=0, description="Groups trained since the learner started.")
    groups_dropped_stale: int = Field(ge=0, description="Groups dropped as stale since the learner started.")
    workers_live: int = Field(ge=0, description="Workers with a live heartbeat.")
    paused: bool = Field(description="The fleet's desired state (what pause / resume last asked for).")
    hyperparameters: dict[str, HparamValue] = Field(
        default_factory=dict, description="The learner's hyperparameters in force."
    )
    sampling: dict[str, float] = Field(
        default_factory=dict,
        description="Rollout sampling values in force (`temperature`, `top_p`), from the workers' reports.",
    )
    last_checkpoint: str | None = Field(default=None, description="Newest checkpoint's path.")
    checkpoint_failure: str | None = Field(
        default=None, description="Why the last checkpoint could not be written; None once one was."
    )
    disk_failure: str | None = Field(
        default=None, description="Why the run directory's disk stopped the run; None: no trouble."
    )
    learner: LearnerStatus | None = Field(
        default=None, description="The learner's raw heartbeat; None without a live one."
    )


class WorkerView(WireModel):
    """One rollout worker, as the sync monitor sees it."""

    worker_id: str = Field(description="The worker's id.")
    engine: Literal["torch", "vllm"] = Field(description="Its generation engine.")
    state: str = Field(
        description="Its `WorkerStatus.state`: `starting`, `generating`, `syncing`, "
        "`stream_full` (its groups wait for room in the full trajectory stream), `paused`, `held`, "
        "`unhealthy` or `stopping`."
    )
    policy_version: int | None = Field(
        default=None, description="Version of the weights it holds; None: initial weights."
    )
    lag: int | None = Field(
        default=None, description="Versions behind the learner's; None when either side is unknown."
    )
    weights_checksum: str | None = Field(default=None, description="Checksum of the weights it holds.")
    last_sync_seconds: float | None = Field(default=None, ge=0, description="Its last sync's wall time.")
    last_sync_bytes: int | None = Field(default=None, ge=0, description="Its last sync's bytes.")
    sync_failures: int = Field(ge=0, description="Failed syncs since it started.")
    heartbeat_age_s: float = Field(ge=0, description="Seconds since its last heartbeat.")
    tokens_per_s: float = Field(ge=0, description="Generated tokens per second, last batch.")
    prompts_in_flight: int = Field(ge=0, description="Prompts taken and not yet published.")
    groups_published: int = Field(ge=0, description="Groups published since it started.")
    temperature: float | None = Field(default=None, description="Sampling temperature in force.")
    top_p: float | None = Field(default=None, description="Nucleus mass in force.")
    in_broadcast_group: bool = Field(description="Whether the newest broadcast's members include it.")
    dropped_reason: str | None = Field(
        default=None, description="Why the newest broadcast dropped it; None when it was not dropped."
    )
    episodes: EpisodeTally | None = Field(
        default=None, description="Its multi-turn episodes so far (rollout.agent); None: it plays none."
    )
    judge: JudgeUsage | None = Field(
        default=None, description="What the LLM judge spent on its groups so far; None: no judge scored them."
    )


class WorkersView(WireModel):
    """`GET /api/v1/workers`."""

    learner_version: int | None = Field(default=None, description="The learner's policy version, if live.")
    workers: list[WorkerView] = Field(description="Every worker with a live heartbeat, by id.")


class WeightsPage(WireModel):
    """`GET /api/v1/weights`: the weight-sync history, newest first."""

    total: int = Field(ge=0, description="Records kept (the history is capped).")
    offset: int = Field(ge=0, description="Records skipped from the newest.")
    limit: int = Field(ge=1, description="Most records in this page.")
    items: list[SyncEvent] = Field(description="Newest first.")


class MetricsPage(WireModel):
    """`GET /api/v1/metrics?since=STEP`: step rows after `since`, oldest first."""

    since: int = Field(ge=0, description="Rows have step > since.")
    rows: list[StepMetrics] = Field(description="Oldest first; at most `limit`.")
    last_step: int = Field(ge=0, description="Step of the newest row kept (0: none): pass as `since` next.")


class EvalsPage(WireModel):
    """`GET /api/v1/evals`: the in-training evaluator's records, oldest first (empty without `eval.every`)."""

    items: list[EvalRecord] = Field(description="Oldest first; the newest `limit`.")


class CommandResponse(WireModel):
    """What a POST / PATCH of the control API answers once every target has: the outcome at each."""

    command_id: str = Field(description="The command's id (also on the control stream and in events).")
    command: Literal["pause", "resume", "stop", "checkpoint", "set_hparams"] = Field(description="Which.")
    outcome: Literal["applied", "rejected", "partial"] = Field(
        description="`applied` everywhere, `rejected` everywhere, or `partial`."
    )
    results: list[CommandResult] = Field(description="One per target that answered.")
    gone: list[str] = Field(
        default_factory=list,
        description="Targets that stopped reporting (heartbeat expired) before they answered.",
    )


class PauseRequest(WireModel):
    """Body of `POST /api/v1/pause` (optional)."""

    reason: str | None = Field(default=None, max_length=500, description="Why, for the logs.")


class StopRequest(WireModel):
    """Body of `POST /api/v1/stop` (optional)."""

    checkpoint: bool = Field(default=True, description="Whether the learner writes a final checkpoint.")


class CheckpointRequest(WireModel):
    """Body of `POST /api/v1/checkpoint` (optional)."""

    tag: CheckpointTag | None = Field(
        default=None,
        description="Name of the checkpoint folder: 1 to 128 of `A-Z a-z 0-9 . _ -`, starting with a letter "
        "or a digit, not `latest` or `step-*`; None: named after the step (`step-000040`).",
    )


class CommandTimeout(WireModel):
    """What a command answers with 504: who has not answered yet, and what the others said."""

    detail: str = Field(description="What timed out, and what to do.")
    command_id: str = Field(description="The command's id; its results may still arrive (see events).")
    waiting_for: list[str] = Field(description="Targets that had not answered.")
    results: list[CommandResult] = Field(description="The answers that did arrive.")
