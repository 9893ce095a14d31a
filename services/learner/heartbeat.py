"""The learner's heartbeat: a thread re-publishing its `LearnerStatus` every couple of seconds, so the
control plane sees it alive through a long step, and a `StateEvent` on each change of phase."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sparkrl.proto import HparamValue, LearnerStatus, StateEvent, StepMetrics
from sparkrl.services.common.settings import LearnerSettings
from sparkrl.services.common.telemetry import LEARNER, LEARNER_HEARTBEAT_S, Telemetry
from sparkrl.services.learner.publisher import WeightPublisher
from sparkrl.services.learner.state import TrainState

log = logging.getLogger("sparkrl.learner")


@dataclass
class LearnerReport:
    """The learner's status fields that change as it runs; the loop writes, the heartbeat reads."""

    phase: str = "starting"
    row: StepMetrics | None = None
    hparams: dict[str, HparamValue] = field(default_factory=dict)
    last_checkpoint: str | None = None
    checkpoint_failure: str | None = None  # why the last checkpoint could not be written; None once one is
    disk_failure: str | None = None  # why the disk stopped the run (learner.min_free_mb, a journal write)
    startup_s: dict[str, float] = field(default_factory=dict)  # start_clock.py


class StatusSource:
    """Builds the status from the report, the train state, the publisher and the learner's settings
    (callable)."""

    def __init__(
        self,
        publisher: WeightPublisher,
        cfg: LearnerSettings,
        data_steps: Callable[[TrainState], int | None] = lambda state: None,
    ) -> None:
        """`cfg`: the learner's settings as configured (what is live comes in the report's `hparams`, which
        the loop sends each turn); `data_steps`: where the data ends the run (None: not known, or no end),
        `data_end.py`."""
        self.publisher, self.cfg, self.data_steps = publisher, cfg, data_steps

    def limit(self, state: TrainState) -> int | None:
        """Where the run ends: learner.max_steps, or sooner where the data runs out."""
        ends = [n for n in (self.cfg.max_steps, self.data_steps(state)) if n is not None]
        return max(1, min(ends)) if ends else None

    def max_staleness(self, report: LearnerReport) -> int:
        """The one in force: the report's (a live change included), the configured one before the first."""
        return int(report.hparams.get("max_staleness", self.cfg.max_staleness))

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
            startup_s=dict(report.startup_s),
            max_steps=self.limit(state),
            last_checkpoint=report.last_checkpoint,
            checkpoint_failure=report.checkpoint_failure,
            disk_failure=report.disk_failure or self.publisher.snapshot_failure,
            hyperparameters=report.hparams,
            max_staleness=self.max_staleness(report),
            heartbeat_at=time.time(),
        )


class Heartbeat(threading.Thread):
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
        self._changes = 0  # updates made; `_published`: of them, the ones the last finished beat carried
        self._published = 0
        self._beaten = threading.Condition()

    def update(self, **changes: object) -> None:
        """Change the report (phase, row, hparams, last_checkpoint); the thread publishes it at once."""
        with self._lock:
            previous = self.report.phase
            self.report = replace(self.report, **changes)  # type: ignore[arg-type]
            self._changes += 1
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

    def flush(self, timeout_s: float = 2.0) -> bool:
        """Wait (at most `timeout_s`) until a beat has carried every update made so far, so that what is
        answered next (a command's result) is already in the status; False when it has not in time."""
        with self._lock:
            wanted = self._changes
        self._wake.set()
        with self._beaten:
            return self._beaten.wait_for(lambda: self._published >= wanted, timeout_s)

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
            report, events, self._events, carried = self.report, self._events, [], self._changes
        for event in events:
            self._safely(lambda event=event: self.telemetry.append(event))
        self._safely(lambda: self.telemetry.put_learner(self.status_of(report, self.state)))
        with self._beaten:
            self._published = max(self._published, carried)
            self._beaten.notify_all()

    @staticmethod
    def _safely(call: Callable[[], object]) -> None:
        try:
            call()
        except Exception:  # a missed beat must never kill the learner; the next one retries
            log.exception("learner heartbeat failed")
