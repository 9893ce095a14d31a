"""Telemetry: what the fleet reports as it runs — step rows, sync records, command results, state changes.

Writers: the learner (step rows, sync records, its state changes and command results) and the rollout
workers (their command results and state changes), all through `services/common/telemetry.py` into
capped Redis streams. Readers: the control service (REST, server-sent events, the page, the fleet's
Prometheus view) and the launcher's progress line. Nothing reads the run directory to learn the live state.
"""

import re
from typing import Literal

from pydantic import Field, field_validator

from sparkrl.proto.base import WireModel
from sparkrl.proto.control import HparamValue

TELEMETRY_SCHEMA_VERSION = 1

METRIC_NAMESPACES = ("loss", "rollout", "sync", "bus", "time", "explore", "checkpoint")
_METRIC_NAME = re.compile(rf"^({'|'.join(METRIC_NAMESPACES)})/[a-z0-9_]+$")


class StepMetrics(WireModel):
    """One row per optimizer step. Writer: learner (also to `RUN_DIR/metrics.jsonl`). Readers: control
    service (`/api/v1/metrics`, events, page), launcher progress line, `sparkrl report`."""

    schema_version: Literal[1] = Field(
        default=TELEMETRY_SCHEMA_VERSION, description="Wire version; readers reject others."
    )
    step: int = Field(ge=1, description="Optimizer steps taken, this one included. Writer: learner.")
    policy_version: int = Field(
        ge=0, description="Policy version this step produced. Writer: learner. Readers: all above."
    )
    time: float = Field(ge=0, description="Unix time (s) the row was written. Writer: learner.")
    metrics: dict[str, float | None] = Field(
        description="Namespaced values (`loss/value`, `rollout/reward_mean`, `sync/seconds`, "
        "`bus/trajectory_lag`, `time/step_seconds`, `explore/sparks`, ...); None where the value was not "
        "finite or not measured. Writer: learner. Readers: control service, report.",
    )
    worker_versions: dict[str, int | None] = Field(
        default_factory=dict,
        description="Worker id → policy version it held when the row was written (None: still on its "
        "initial weights). Writer: learner (from the workers' heartbeats). Readers: page, report.",
    )
    hparams: dict[str, HparamValue] = Field(
        default_factory=dict,
        description="The learner's hyperparameters in force for this step (`lr`, `beta`, `loss`, ...), "
        "so a live change is visible in the data. Writer: learner. Readers: page, report.",
    )
    top_sparks: dict[str, int] = Field(
        default_factory=dict,
        description="The step's most frequent sparks (sampled tokens with p < 0.1 in correct responses), "
        "decoded → count, at most 10. Writer: learner. Reader: report (the run's most frequent).",
    )

    @field_validator("metrics")
    @classmethod
    def _namespaced(cls, metrics: dict[str, float | None]) -> dict[str, float | None]:
        bad = [name for name in metrics if not _METRIC_NAME.match(name)]
        if bad:
            raise ValueError(f"metric names must be `<{'|'.join(METRIC_NAMESPACES)}>/<snake_case>`: {bad}")
        return metrics

    def value(self, name: str) -> float | None:
        """`metrics[name]`, None when absent."""
        return self.metrics.get(name)


class SyncEvent(WireModel):
    """One weight broadcast, as the learner saw it. Writer: learner (publisher thread). Readers: control
    service (`/api/v1/weights`, events, page), report."""

    schema_version: Literal[1] = Field(
        default=TELEMETRY_SCHEMA_VERSION, description="Wire version; readers reject others."
    )
    version: int = Field(ge=0, description="Policy version broadcast. Writer: learner.")
    epoch: int = Field(ge=0, description="Broadcast group epoch it used. Writer: learner.")
    announced_at: float = Field(ge=0, description="Unix time (s) of the announcement. Writer: learner.")
    outcome: Literal["ok", "failed", "no_members"] = Field(
        description="`ok`: every member acknowledged the checksum; `failed`: the epoch died (see `error`); "
        "`no_members`: announced (and snapshotted) with nobody to send to. Writer: learner."
    )
    phase: Literal["join", "connect", "transfer", "verify"] | None = Field(
        default=None, description="Where a failed broadcast failed. Writer: learner. None unless failed."
    )
    error: str | None = Field(
        default=None, max_length=2000, description="Why it failed. Writer: learner. None unless failed."
    )
    bytes: int = Field(ge=0, description="Weight bytes of the version. Writer: learner.")
    buckets: int = Field(ge=0, description="Buckets it travels in. Writer: learner.")
    seconds: float | None = Field(
        default=None,
        ge=0,
        description="Announce → every member acknowledged, seconds. Writer: learner. None unless `ok`.",
    )
    transfer_seconds: float | None = Field(
        default=None,
        ge=0,
        description="First bucket sent → last delivered, seconds. Writer: learner. None unless `ok`.",
    )
    members: list[str] = Field(
        default_factory=list,
        description="Worker ids the version was sent to, in rank order. Writer: learner.",
    )
    acknowledged: list[str] = Field(
        default_factory=list,
        description="Members that acknowledged the checksum. Writer: learner. Readers: page (sync table).",
    )
    dropped: dict[str, str] = Field(
        default_factory=dict,
        description="Worker id → why it is out of this broadcast or the next (did not join in time, no "
        "checksum acknowledgement, checksum mismatch, heartbeat expired, stopping). Writer: learner. "
        "Readers: page (highlighted), report.",
    )


class CommandResult(WireModel):
    """A control command's outcome at one target. Writers: learner, rollout workers. Reader: control
    service (the POST that issued the command returns it; events)."""

    schema_version: Literal[1] = Field(
        default=TELEMETRY_SCHEMA_VERSION, description="Wire version; readers reject others."
    )
    command_id: str = Field(
        min_length=1, max_length=128, description="`ControlCommand.command_id` it answers. Writer: target."
    )
    command: Literal["pause", "resume", "stop", "checkpoint", "set_hparams"] = Field(
        description="Which command. Writer: target."
    )
    target: str = Field(
        min_length=1,
        max_length=160,
        description="`learner`, or `worker:<worker id>`. Writer: target. Reader: control service (who "
        "answered).",
    )
    outcome: Literal["applied", "rejected"] = Field(
        description="`rejected` leaves everything as it was (see `detail`). Writer: target."
    )
    detail: str = Field(
        max_length=2000, description="What happened, for people: a checkpoint's path, why it was rejected."
    )
    step: int | None = Field(
        default=None,
        ge=0,
        description="Learner: the step boundary it was applied at. Writer: learner. None for workers.",
    )
    values: dict[str, HparamValue] = Field(
        default_factory=dict,
        description="`set_hparams`: the values now in force at this target. Writer: target. Empty otherwise.",
    )
    at: float = Field(ge=0, description="Unix time (s) it was applied or rejected. Writer: target.")


class StateEvent(WireModel):
    """A service changed state (training → paused, generating → stopping, ...). Writers: learner, rollout
    workers. Readers: control service (events, page)."""

    schema_version: Literal[1] = Field(
        default=TELEMETRY_SCHEMA_VERSION, description="Wire version; readers reject others."
    )
    target: str = Field(
        min_length=1,
        max_length=160,
        description="`learner`, `worker:<worker id>`, or `feed` (the prompts' flow to the fleet: `held` by a "
        "burst of dead letters, `flowing` again after `resume`). Writer: that service (a worker for `feed`).",
    )
    state: str = Field(
        min_length=1, max_length=32, description="The new state, as in its status. Writer: that service."
    )
    previous: str | None = Field(
        default=None, max_length=32, description="The state before. None at start. Writer: that service."
    )
    step: int | None = Field(
        default=None, ge=0, description="Learner's step at the change. None for workers. Writer: learner."
    )
    detail: str | None = Field(
        default=None,
        max_length=2000,
        description="Why, for an alert (`unhealthy`: the engine's error; `held`: the dead-letter burst). "
        "Writer: that service. Reader: control service (`/api/v1/events`). None: no more to say.",
    )
    at: float = Field(ge=0, description="Unix time (s) of the change. Writer: that service.")


class EvalRecord(WireModel):
    """One held-out evaluation of a published policy version. Writer: the evaluator (also to
    `RUN_DIR/eval.jsonl`). Readers: control service (events), `sparkrl report`, bench/learning_quality."""

    schema_version: Literal[1] = Field(
        default=TELEMETRY_SCHEMA_VERSION, description="Wire version; readers reject others."
    )
    policy_version: int = Field(
        ge=0, description="Version evaluated (0: the initial model). Writer: evaluator."
    )
    time: float = Field(ge=0, description="Unix time (s) the evaluation finished. Writer: evaluator.")
    task: str = Field(min_length=1, max_length=64, description="`countdown` (held-out split) or `math`.")
    problems: int = Field(ge=1, description="Problems evaluated.")
    n: int = Field(ge=1, description="Samples per problem.")
    temperature: float = Field(gt=0, description="Sampling temperature of the n samples.")
    greedy: float = Field(ge=0, le=1, description="Accuracy of argmax decoding.")
    pass_at: dict[str, float] = Field(
        description="k (as text) → unbiased pass@k over the problems, for k = 1, powers of two, n."
    )
    seconds: float = Field(ge=0, description="How long the evaluation took.")
