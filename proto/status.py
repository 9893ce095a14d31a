"""Heartbeats: what each service reports to the controller, several times a minute.

Writers: each rollout worker (`WorkerStatus`) and the learner (`LearnerStatus`), into Redis. Readers: the
controller's status API, the web page, and the Prometheus exporter. A status older than a few heartbeat
periods means the service is gone.
"""

from typing import Literal

from pydantic import Field

from sparkrl.proto.base import WireModel
from sparkrl.proto.control import HparamValue
from sparkrl.proto.reward import JudgeUsage

STATUS_SCHEMA_VERSION = 1


class EpisodeTally(WireModel):
    """A worker's multi-turn episodes (rollout.agent) since it started, for the live page (its Prometheus
    counters say the same). Writer: rollout worker. Readers: control service, the page."""

    episodes: dict[str, int] = Field(
        default_factory=dict,
        description="Episodes by how each ended: done, max_turns, max_tokens, no_exact_continuation, "
        "environment_error.",
    )
    turns: int = Field(default=0, ge=0, description="Model turns of those episodes.")
    tool_calls: dict[str, int] = Field(
        default_factory=dict,
        description="Tool calls by status: ok, malformed, unknown_tool, bad_arguments, tool_error, and the "
        "sandbox's timeout, cpu_limit, killed.",
    )
    splits: int = Field(
        default=0,
        ge=0,
        description="Episodes split into another sample (the template could not extend them).",
    )
    environment_calls: int = Field(default=0, ge=0, description="The environment's answers to model turns.")
    environment_seconds: float = Field(default=0.0, ge=0, description="Their total wall time, seconds.")


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
    state: Literal[
        "starting", "generating", "syncing", "stream_full", "paused", "held", "unhealthy", "stopping"
    ] = Field(
        description="`syncing`: receiving weights; `stream_full`: groups it made wait for room in the full "
        "trajectory stream (backpressure: the learner sets the pace, or is paused); `held`: takes no "
        "prompts because the feed is held (a burst of dead letters); `unhealthy`: takes no prompts because "
        "its model or engine fails to generate (its prompts go back to the fleet). Writer: rollout worker. "
        "Readers: controller, `sparkrl status`."
    )
    state_reason: str | None = Field(
        default=None,
        max_length=2000,
        description="Why it is `unhealthy` (the model's or engine's error) or `held` (the burst that held "
        "the feed). Writer: rollout worker. Readers: operators (its `/healthz` and `state` event say the "
        "same). None in other states.",
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
    last_sync_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Bytes of its last weight sync (broadcast or snapshot). Writer: rollout worker. Reader: "
        "sync monitor. None before the first sync.",
    )
    sync_failures: int = Field(
        default=0,
        ge=0,
        description="Weight syncs that failed since start. Writer: rollout worker. Readers: sync monitor, "
        "Prometheus.",
    )
    timings: dict[str, float] = Field(
        default_factory=dict,
        description="Seconds of each part of its last batch: `sync` (waiting for and loading weights), "
        "`generate`, `score`, `publish`. Writer: rollout worker. Reader: learner (the step row's "
        "`time/worker_*_s`).",
    )
    startup_s: dict[str, float] = Field(
        default_factory=dict,
        description="Seconds each phase of its start took, in order, from the process's start: `imports`, "
        "`engine` (the model loaded into the engine), `ready` (bus, weight sync, heartbeat). Writer: "
        "rollout worker. Reader: `sparkrl up` (the start-up line, summary.json). Empty until it is up.",
    )
    started_at: float | None = Field(
        default=None,
        ge=0,
        description="Unix time (s) this worker process started: a restart under the same id (a container "
        "restarted in place) is a new incarnation. Writer: rollout worker. Reader: learner (admits a new "
        "incarnation at once instead of keeping it out for the old one's failure). None when not reported.",
    )
    in_hand_version: int | None = Field(
        default=None,
        ge=0,
        description="Oldest policy version of the groups this worker has made but not yet published (they "
        "wait on a full trajectory stream while it follows newer weights). Writer: rollout worker. Reader: "
        "learner (waits for them rather than stepping past their reach). None when nothing is in hand.",
    )
    progress_at: float | None = Field(
        default=None,
        ge=0,
        description="Unix time (s) the worker's loop last made progress (a batch, a sync, an idle poll); "
        "a live heartbeat with an old `progress_at` is a hung loop. Writer: rollout worker. Reader: "
        "learner (leaves it out of broadcasts). None when not reported.",
    )
    episodes: EpisodeTally | None = Field(
        default=None,
        description="Its multi-turn episodes so far (rollout.agent). Writer: rollout worker. Readers: "
        "control service, the page. None: it plays no episodes.",
    )
    judge: JudgeUsage | None = Field(
        default=None,
        description="What the LLM judge spent scoring its groups since it started, as the reward service "
        "reported it per batch. Writer: rollout worker. Readers: control service, the page. None: no "
        "judge scored its items.",
    )
    temperature: float | None = Field(
        default=None,
        gt=0,
        description="Sampling temperature in force (changed live by `set_hparams`). Writer: rollout worker. "
        "Reader: controller. None when not reported.",
    )
    top_p: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Nucleus mass in force. Writer: rollout worker. Reader: controller. None when not "
        "reported.",
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
    last_reward: float | None = Field(
        default=None,
        description="Mean reward of the last step's groups. Writer: learner. Reader: controller. None "
        "before the first step.",
    )
    last_entropy: float | None = Field(
        default=None,
        description="Token entropy of the last step (learner's forward). Writer: learner. Reader: "
        "controller. None before the first step.",
    )
    tokens_per_s: float | None = Field(
        default=None,
        ge=0,
        description="Tokens trained per second in the last step. Writer: learner. Readers: controller, "
        "Prometheus. None before the first step.",
    )
    groups_dropped_stale: int = Field(
        default=0,
        ge=0,
        description="Groups dropped as older than `max_staleness` since start. Writer: learner. Reader: "
        "controller.",
    )
    max_steps: int | None = Field(
        default=None,
        ge=1,
        description="Where the run ends: learner.max_steps, or sooner where the data runs out (the steps "
        "taken plus those the prompts left make, once all are fed). Writer: learner. Readers: page, "
        "`sparkrl up`'s progress line. None: it runs until stopped.",
    )
    last_checkpoint: str | None = Field(
        default=None,
        max_length=4096,
        description="Path of the newest checkpoint written. Writer: learner. Reader: controller. None "
        "before the first.",
    )
    checkpoint_failure: str | None = Field(
        default=None,
        max_length=2000,
        description="Why the last checkpoint could not be written (path, error, free space); training goes "
        "on journaling. Writer: learner. Readers: controller, page. None: the last one was written (or none "
        "was tried).",
    )
    disk_failure: str | None = Field(
        default=None,
        max_length=2000,
        description="Why the run directory's disk stopped the run: free space below `learner.min_free_mb`, "
        "or a journal write that failed (path, error, free space). Writer: learner. Readers: controller, "
        "page. None: no trouble.",
    )
    hyperparameters: dict[str, HparamValue] = Field(
        default_factory=dict,
        description="Hyperparameters in force (`lr`, `max_staleness`, `kappa`, `loss` and the loss's own, "
        "...). Writer: learner. Readers: controller (validates live changes against `loss`), page.",
    )
    max_staleness: int | None = Field(
        default=None,
        ge=0,
        description="learner.max_staleness in force (a live change included): a group sampled more than "
        "this many versions before `policy_version` is not trained. Writer: learner. Reader: rollout "
        "worker (does not publish a group that would arrive too stale). Unit: policy versions. None: not "
        "said (a status written before this field): the worker publishes every group.",
    )
    group_epoch: int = Field(
        ge=0,
        description="Generation of the broadcast process group, as in `WeightAnnouncement.group_epoch`. "
        "Writer: learner. Reader: sync monitor.",
    )
    startup_s: dict[str, float] = Field(
        default_factory=dict,
        description="Seconds each phase of its start took, in order, from the process's start: `imports`, "
        "`comm` (the process group; DeepSpeed compiles its op here on a first run), `model` (weights and "
        "tokenizer loaded), `engine` (DeepSpeed's engine, a checkpoint restored), "
        "`ready` (bus, weight files, the first announcement). Writer: learner. Reader: `sparkrl up` (the "
        "start-up line, summary.json). Empty until it is up.",
    )
    members: list[str] = Field(
        default_factory=list,
        description="Worker ids in the current broadcast group, in rank order (rank 1 first). Writer: "
        "learner. Reader: sync monitor.",
    )
    heartbeat_at: float = Field(
        ge=0, description="Unix time (s) of this report. Writer: learner. Reader: controller (liveness)."
    )
