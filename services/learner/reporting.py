"""What the learner reports: the step row, its heartbeat, and the run's files.

- `step_row` builds the one `StepMetrics` per step (namespaced metrics, the fleet's versions, the
  hyperparameters in force).
- `Reporter` is the learner's heartbeat: a thread re-publishing its `LearnerStatus` every couple of
  seconds, so the control plane sees it alive through a long step, and a `StateEvent` on each change.
- `RunLog` appends `metrics.jsonl`, `trained_groups.jsonl` (the audit trail of "each group is trained
  once") and `weights.jsonl` (the sync history) to the run directory, flushed per record: the record of
  the run for `sparkrl report`, never read back to learn the live state.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from sparkrl.proto import (
    HparamValue,
    LearnerStatus,
    StateEvent,
    StepMetrics,
    SyncEvent,
    TrajectoryGroup,
    WorkerStatus,
)
from sparkrl.proto.run_files import PromptCounts
from sparkrl.services.common.bus import QueueDepth
from sparkrl.services.common.telemetry import LEARNER, LEARNER_HEARTBEAT_S, Telemetry
from sparkrl.services.learner.ledger import Batch
from sparkrl.services.learner.publisher import WeightPublisher
from sparkrl.services.learner.state import TrainState

log = logging.getLogger("sparkrl.learner")


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def fleet_timings(workers: Iterable[WorkerStatus]) -> dict[str, float]:
    """The fleet's mean seconds per part of its last batch (`worker_generate`, …), over live workers."""
    parts: dict[str, list[float]] = {}
    for status in workers:
        for part, seconds in status.timings.items():
            parts.setdefault(f"worker_{part}", []).append(seconds)
    return {part: sum(values) / len(values) for part, values in parts.items()}


def step_row(
    batch: Batch,
    stats: dict[str, float],
    state: TrainState,
    seconds: float,
    sync: SyncEvent | None,
    fleet: dict[str, int | None],
    depth: tuple[QueueDepth, QueueDepth],
    hparams: dict[str, HparamValue],
    timings: dict[str, float] | None = None,
    exploration: dict[str, float] | None = None,
    top_sparks: dict[str, int] | None = None,
) -> StepMetrics:
    """The step's row. `stats` are train_step's (loss statistics); `depth` is (trajectories, prompts);
    `timings` (seconds by part: the learner's, and the fleet's `worker_*`) become `time/<part>_s`;
    `exploration` is exploration.py's `explore/*`."""
    rewards = [r for g in batch.groups for r in g.rewards]
    temperatures = [g.sampling.temperature for g in batch.groups]
    trajectories, prompts = depth
    tokens = stats.get("tokens", 0.0)
    lags = [state.policy_version - v for v in fleet.values() if v is not None]
    metrics: dict[str, float | None] = {
        f"loss/{'value' if name == 'loss' else name}": value
        for name, value in stats.items()
        if name != "tokens"
    }
    metrics |= {
        "rollout/reward_mean": sum(rewards) / max(len(rewards), 1),
        "rollout/groups": float(len(batch.groups)),
        "rollout/tokens": tokens,
        "rollout/staleness_mean": batch.staleness_mean,
        "rollout/dropped_stale": float(batch.dropped_stale),
        "rollout/temperature": sum(temperatures) / max(len(temperatures), 1),
        "sync/seconds": sync.seconds if sync else None,
        "sync/version": float(sync.version) if sync else None,
        "sync/lag_max": float(max(lags)) if lags else None,
        "bus/trajectory_lag": float(trajectories.lag),
        "bus/trajectory_pending": float(trajectories.pending),
        "bus/prompt_lag": float(prompts.lag),
        "time/step_seconds": seconds,
        "time/tokens_per_s": tokens / seconds if seconds > 0 else None,
    }
    metrics["rollout/dropped_stale_total"] = float(state.groups_dropped_stale)
    metrics["loss/nonfinite_skipped_total"] = float(state.nonfinite_skipped)  # updates not applied
    metrics |= status_counts(batch.groups)
    metrics |= {f"time/{part}_s": value for part, value in (timings or {}).items()}
    metrics |= exploration or {}
    return StepMetrics(
        step=state.step,
        policy_version=state.policy_version,
        time=time.time(),
        metrics={name: _finite(value) for name, value in metrics.items()},
        worker_versions=fleet,
        hparams=hparams,
        top_sparks=top_sparks or {},
    )


@dataclass
class LearnerReport:
    """The learner's status fields that change as it runs; the loop writes, the heartbeat reads."""

    phase: str = "starting"
    row: StepMetrics | None = None
    hparams: dict[str, HparamValue] = field(default_factory=dict)
    last_checkpoint: str | None = None


class StatusSource:
    """Builds the status from the report, the train state and the publisher (callable)."""

    def __init__(
        self,
        publisher: WeightPublisher,
        max_steps: int | None,
        data_steps: Callable[[TrainState], int | None] = lambda state: None,
    ) -> None:
        """`data_steps`: where the data ends the run (None: not known, or no end), `data_end.py`."""
        self.publisher, self.max_steps, self.data_steps = publisher, max_steps, data_steps

    def limit(self, state: TrainState) -> int | None:
        """Where the run ends: learner.max_steps, or sooner where the data runs out."""
        ends = [n for n in (self.max_steps, self.data_steps(state)) if n is not None]
        return max(1, min(ends)) if ends else None

    def __call__(self, report: LearnerReport, state: TrainState) -> LearnerStatus:
        row, sync = report.row, self.publisher.last_sync
        return LearnerStatus(
            step=state.step,
            policy_version=state.policy_version,
            state=report.phase,
            groups_trained=state.groups_trained,
            groups_dropped_stale=state.groups_dropped_stale,
            last_loss=row.value("loss/value") if row else None,
            last_reward=row.value("rollout/reward_mean") if row else None,
            last_entropy=row.value("loss/entropy") if row else None,
            tokens_per_s=row.value("time/tokens_per_s") if row else None,
            last_sync_seconds=sync.seconds if sync else None,
            group_epoch=self.publisher.epoch,
            members=list(self.publisher.members),
            max_steps=self.limit(state),
            last_checkpoint=report.last_checkpoint,
            hyperparameters=report.hparams,
            heartbeat_at=time.time(),
        )


class Reporter(threading.Thread):
    """Publishes `LearnerStatus` every LEARNER_HEARTBEAT_S and as soon as `update` changes it, plus a
    `StateEvent` per change. All network work happens on this thread: `update` never blocks the loop
    (a Redis that is down must not keep the learner from writing its checkpoint)."""

    def __init__(self, telemetry: Telemetry, state: TrainState, status_of: StatusSource) -> None:
        super().__init__(name="learner-heartbeat", daemon=True)
        self.telemetry, self.state, self.status_of = telemetry, state, status_of
        self.report = LearnerReport()
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._events: list[StateEvent] = []

    def update(self, **changes: object) -> None:
        """Change the report (phase, row, hparams, last_checkpoint); the thread publishes it at once."""
        with self._lock:
            previous = self.report.phase
            self.report = replace(self.report, **changes)  # type: ignore[arg-type]
            if self.report.phase != previous:
                self._events.append(
                    StateEvent(
                        target=LEARNER,
                        state=self.report.phase,
                        previous=previous,
                        step=self.state.step,
                        at=time.time(),
                    )
                )
        self._wake.set()

    def run(self) -> None:
        while not self.stopped.is_set():
            self._wake.wait(LEARNER_HEARTBEAT_S)
            self._wake.clear()
            self.beat()

    def close(self, timeout_s: float = 5.0) -> None:
        """A last beat (the final state), then stop; bounded, so a dead Redis cannot hold the exit."""
        self.stopped.set()
        self._wake.set()
        self.join(timeout_s)
        if not self.is_alive():
            self.beat()

    def beat(self) -> None:
        with self._lock:
            report, events, self._events = self.report, self._events, []
        for event in events:
            self._safely(lambda event=event: self.telemetry.append(event))
        self._safely(lambda: self.telemetry.put_learner(self.status_of(report, self.state)))

    @staticmethod
    def _safely(call: Callable[[], object]) -> None:
        try:
            call()
        except Exception:  # a missed beat must never kill the learner; the next one retries
            log.exception("learner heartbeat failed")


class RunLog:
    """The run's own record, appended and flushed per record."""

    def __init__(self, run_dir: Path) -> None:
        self.metrics = (run_dir / "metrics.jsonl").open("a")
        self.trained = (run_dir / "trained_groups.jsonl").open("a")
        self.weights = (run_dir / "weights.jsonl").open("a")
        self.samples = (run_dir / "samples.jsonl").open("a")
        self._weights_lock = threading.Lock()  # the publisher thread writes sync events

    def write_step(self, row: StepMetrics, state: TrainState) -> None:
        self.metrics.write(row.model_dump_json() + "\n")
        self.metrics.flush()
        self.trained.write(json.dumps({"step": state.step, "group_ids": state.trained_group_ids}) + "\n")
        self.trained.flush()
        loss = row.value("loss/value")
        reward = row.value("rollout/reward_mean") or 0.0
        log.info("step %d: reward %.3f loss %s", row.step, reward, "n/a" if loss is None else f"{loss:.4g}")

    def write_samples(self, rows: list[dict[str, object]]) -> None:
        for row in rows:
            self.samples.write(json.dumps(row, default=str) + "\n")
        self.samples.flush()

    def write_sync(self, event: SyncEvent) -> None:
        with self._weights_lock:
            self.weights.write(event.model_dump_json() + "\n")
            self.weights.flush()

    def close(self) -> None:
        for file in (self.metrics, self.trained, self.weights, self.samples):
            file.close()


ENDED_FILE = "ended.json"
STATUSES = ("correct", "incorrect", "no_answer", "timeout", "error")


def status_counts(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """`rollout/status_<status>`: the step's completions by the reward service's verdict."""
    counts = dict.fromkeys(STATUSES, 0)
    for group in groups:
        for detail in group.reward_details or []:
            if detail is not None and detail.status in counts:
                counts[detail.status] += 1
    return {f"rollout/status_{status}": float(count) for status, count in counts.items()}


def sample_rows(step: int, groups: list[TrajectoryGroup], count: int) -> list[dict[str, object]]:
    """The first completion of each of the step's first `count` groups, for people to read: prompt,
    completion, reward, verdict."""
    rows = []
    for group in groups[:count]:
        if not group.completions:
            continue
        detail = group.reward_details[0] if group.reward_details else None
        rows.append(
            {
                "step": step,
                "group_id": group.group_id,
                "prompt": group.prompt.text if group.prompt.text is not None else group.prompt.messages,
                "completion": group.completions[0].text,
                "reward": group.rewards[0],
                "status": detail.status if detail is not None else None,
                "detail": detail.detail if detail is not None else None,
            }
        )
    return rows


def write_ended(run_dir: Path, reason: str, step: int, prompts: PromptCounts | None = None) -> None:
    """Why the run ended (`learner.max_steps` reached, the data ran out, a stop command, a signal), for
    the launcher's summary; `prompts`: how the prompts fed ended, when the data ran out."""
    ended: dict[str, object] = {"reason": reason, "step": step, "time": time.time()}
    if prompts is not None:
        ended["prompts"] = prompts.model_dump()
    (run_dir / ENDED_FILE).write_text(json.dumps(ended))
