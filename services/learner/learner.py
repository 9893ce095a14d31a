"""The learner: one process, one loop — control boundary → collect batch → train step → publish weights.

Groups are acknowledged only after the step that used them; each trained group id is also recorded in
Redis before the ack, so a crash between the two never trains a group twice. Groups sampled more than
`max_staleness` versions ago are dropped (acknowledged, counted). Weights go out through a publisher
thread, so a slow or dead worker never stalls training. Control commands (pause, resume, checkpoint,
stop, hyperparameters) are applied between steps; a pause keeps the groups in hand and reads no more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from deepspeed import DeepSpeedEngine
from transformers import PreTrainedTokenizerBase

from sparkrl.proto import ControlCommand, RankOrder, StepMetrics
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import LearnerSettings, WeightSyncSettings
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.learner.checkpoint import (
    CheckpointError,
    TrainState,
    cpu_weights,
    save_checkpoint,
)
from sparkrl.services.learner.collect import BatchCollector
from sparkrl.services.learner.control import LearnerControl, hparams_in_force
from sparkrl.services.learner.exploration import exploration_stats, spark_tokens
from sparkrl.services.learner.guard import StepGuard, Streak
from sparkrl.services.learner.ledger import Batch, Ledger
from sparkrl.services.learner.metrics import LearnerMetrics
from sparkrl.services.learner.publisher import WeightPublisher
from sparkrl.services.learner.ranks import RankLost, Ranks, lost, train_order
from sparkrl.services.learner.reporting import Reporter, RunLog, fleet_timings, sample_rows, step_row
from sparkrl.services.learner.tracking import Tracker
from sparkrl.services.learner.update import compute_update
from sparkrl.services.learner.validate import ModelLimits

log = logging.getLogger("sparkrl.learner")

T = TypeVar("T")

PAUSED_POLL_S = 0.2  # how often a paused learner looks at the control stream
TOP_SPARKS = 10  # sparks per step row, the most frequent


Setup = tuple[DeepSpeedEngine, PreTrainedTokenizerBase, TrainState, bool, torch.nn.Module | None]


@dataclass
class Learner:
    """The training loop's parts, built once by `main`; `run` is the loop itself."""

    engine: DeepSpeedEngine
    tokenizer: PreTrainedTokenizerBase
    bus: RedisBus
    telemetry: Telemetry
    cfg: LearnerSettings  # live: control commands change it between steps
    sync: WeightSyncSettings
    run_dir: Path
    pad_id: int
    state: TrainState
    publisher: WeightPublisher
    control: LearnerControl
    reporter: Reporter
    metrics: LearnerMetrics
    run_log: RunLog
    stop: threading.Event
    ledger: Ledger  # exactly-once: journal → trained marks → ack → checkpoint trim
    reference: torch.nn.Module | None = None  # the frozen initial model of learner.kl (None: no KL term)
    tracker: Tracker | None = None  # learner.tracking's backends
    ranks: Ranks | None = None  # a data-parallel learner's orders to its other ranks (None: one rank)
    collector: BatchCollector = field(init=False)
    stop_command: ControlCommand | None = field(default=None, init=False)  # the one that ended the run
    waited_data: float = field(default=0.0, init=False)  # seconds in `fill` since the last step
    waited_fleet: float = field(default=0.0, init=False)  # seconds in `fleet_in_reach` since the last step
    ended: str | None = field(default=None, init=False)  # why the run is over, once it is
    rank_lost: str | None = field(default=None, init=False)  # why the ranks cannot go on, once so
    crashed: str | None = field(default=None, init=False)  # an exception out of the loop (service.main)
    failed: str | None = field(default=None, init=False)  # why the run ends non-zero (service.close)
    guard: StepGuard = field(init=False)  # a step that raised or was not finite; why the run must stop

    def __post_init__(self) -> None:
        self.collector = BatchCollector(self.bus, self.cfg, ModelLimits.of(self.engine.module, self.cfg))
        self.guard = StepGuard(
            self.engine,
            self.cfg,
            self.pad_id,
            self.reference,
            self.ranks is None,
            self.bus,
            self.collector,
            self.control,
            self.metrics,
            self.state,
            Streak(self.cfg.max_nonfinite_steps),
        )

    def turn(self) -> bool:
        """One pass of the loop: the control boundary, then a step (or a paused wait). False once the run
        is over: max_steps, `stop`, or a stop command (kept in `stop_command`, answered at close)."""
        cfg, state = self.cfg, self.state
        if self.stop.is_set() or self.stop_command is not None or self.rank_lost or self.guard.stop:
            return False
        if cfg.max_steps is not None and state.step >= cfg.max_steps:
            self.ended = f"learner.max_steps ({cfg.max_steps}) reached"
            return False
        if self.collector.exhausted is not None and not self.collector.groups:
            self.ended = self.collector.exhausted
            return False
        todo = self.control.boundary(state.step)
        for command in todo.checkpoints:
            try:
                path = self.checkpoint(command.body.tag)  # type: ignore[union-attr]
            except CheckpointError as exc:
                log.error("%s (a checkpoint command); training goes on", exc)
                self.control.answer(command, "rejected", str(exc), state.step)
                continue
            self.control.answer(command, "applied", f"checkpoint {path}", state.step)
        if todo.stop is not None:
            self.stop_command = todo.stop
            return False
        self.reporter.update(
            phase="paused" if self.control.paused else "training",
            hparams=hparams_in_force(self.engine, cfg),
        )
        self.metrics.paused.set(float(self.control.paused))
        if self.control.paused:
            self.ledger.rebuild_if_wiped()
            self.collector.keep_alive()
            self.stop.wait(PAUSED_POLL_S)
            return True
        mark = time.perf_counter()
        in_reach = self.fleet_in_reach()
        self.waited_fleet += time.perf_counter() - mark
        if not in_reach:
            return True  # a command came in: to the boundary first
        mark = time.perf_counter()
        batch = self.collector.fill(state.policy_version, self.interrupted)
        self.waited_data += time.perf_counter() - mark
        if batch is not None:
            self.train(batch)
        return True  # after a last partial step, or none, the next turn sees the data ran out

    def fleet_in_reach(self) -> bool:
        """A slow broadcast costs time, not data: before a step after which the fleet's groups would be too
        stale to train on, wait (at most `sync.timeout_s`) until every live member holds a version within
        reach, and has published the older groups it had in hand (reading them ahead meanwhile, so a full
        stream cannot keep them out). A member the publisher dropped (hung, straggling) is not waited for,
        nor is anyone once the collector holds all it could train in time. False: interrupted."""
        version, cfg = self.state.policy_version, self.cfg
        floor = min(version, version + 1 - cfg.max_staleness)
        deadline = time.monotonic() + self.sync.timeout_s
        while True:
            excluded = set(self.publisher.excluded)
            held, oldest = self.telemetry.worker_versions(), self.telemetry.worker_oldest_versions()
            behind = {w: v for w, v in held.items() if w not in excluded and (v or 0) < floor}
            in_hand = {w: v for w, v in oldest.items() if w not in excluded and (v or 0) < floor}
            # Groups in hand need room in the stream: read ahead, unless the collector is already full.
            if not behind and (not in_hand or not self.collector.read_ahead(version)):
                return True
            if self.interrupted():
                return False
            if time.monotonic() > deadline:
                log.warning(
                    "workers %s are still behind version %d after %.0fs; training on",
                    behind or in_hand,
                    floor,
                    self.sync.timeout_s,
                )
                return True
            time.sleep(0.05)

    def replay(self) -> int:
        """Redo the steps the journal holds after the checkpoint, in order, as the same steps: their
        groups were acknowledged, so only this makes the resumed model reflect them. Returns how many."""
        replayed = 0
        for step, batch in self.ledger.replay(self.state.step):
            log.info("replaying step %d from the journal (%d groups)", step, len(batch.entries))
            if self.train(batch, journaled=True) is None:
                raise RuntimeError(
                    f"replaying step {step} from {self.ledger.journal.path(step)} failed; see above"
                )
            replayed += 1
        if replayed:
            log.info("replayed %d steps from the journal: the model reflects them again", replayed)
        return replayed

    def interrupted(self) -> bool:
        self.ledger.rebuild_if_wiped()  # between reads: before the next group's trained mark is looked up
        return self.stop.is_set() or self.control.pending()

    def train(self, batch: Batch, journaled: bool = False) -> StepMetrics | None:
        """One optimizer step on `batch`: update, journal, acknowledge, publish, report, maybe checkpoint.
        `journaled`: a replay, whose entries are in the journal already. None: no step was taken (it
        raised, or none of its update was applied: its groups went back), or the run must stop
        (`guard.stop`)."""
        cfg, state = self.cfg, self.state
        started = time.monotonic()
        timings = {"wait_data": self.waited_data, "wait_fleet": self.waited_fleet}
        self.waited_data = self.waited_fleet = 0.0
        stats = self.update(batch, timings)
        if stats is None:
            return None
        if stats.get("updates_skipped"):
            applied = self.guard.not_applied(batch, stats, journaled)
            if applied is None:
                return None
            batch = applied
        else:
            self.guard.streak.reset()
            self.metrics.nonfinite_in_a_row.set(0)
        mark = time.perf_counter()
        weights = self.full_weights()
        if not self.guard.publishable(weights, self.ledger.saved_step):
            return None
        timings["copy_weights"] = time.perf_counter() - mark
        state.step += 1
        state.policy_version += 1
        mark = time.perf_counter()
        acked = self.ledger.commit(state, batch, journaled) + self.collector.take_acked()
        timings["bookkeeping"], mark = time.perf_counter() - mark, time.perf_counter()
        self.publisher.submit(state.policy_version, weights)
        timings["publish"] = time.perf_counter() - mark  # the broadcast runs on the publisher's thread
        if state.step == cfg.max_steps:
            self.settle_fleet()
        depth = (self.bus.pending_info("trajectories"), self.bus.pending_info("prompts"))
        fleet = self.telemetry.live_workers()
        row = step_row(
            batch,
            stats,
            state,
            time.monotonic() - started,
            self.publisher.last_sync,
            {w: s.policy_version for w, s in fleet.items()},
            depth,
            hparams_in_force(self.engine, cfg, batch.groups),
            timings | fleet_timings(fleet.values()),
            exploration_stats(batch.groups, cfg.proxy_kappa),
            self._top_sparks(batch),
        )
        self.run_log.write_step(row, state)
        self.run_log.write_samples(sample_rows(state.step, batch.groups, cfg.samples_per_step))
        if self.tracker is not None:
            self.tracker.log(row)
        self.telemetry.append(row)
        self.metrics.observe_step(row, len(batch.groups), acked)
        self.reporter.update(row=row)
        if state.step % cfg.checkpoint_every == 0:
            self.checkpoint_or_log()
        return row

    def settle_fleet(self) -> None:
        """At the last step: the last row should show where the fleet ends up, not where it was
        mid-broadcast; and a worker outside the group (it joined late, or is still loading) catches up
        over HTTP while we still serve the snapshot: a fleet under compose or Kubernetes outlives us."""
        self.publisher.flush(self.sync.timeout_s)
        fleet = tuple(dict.fromkeys([*self.publisher.members, *self.telemetry.worker_versions()]))
        self.telemetry.wait_for_fleet(fleet, self.state.policy_version, timeout_s=self.sync.timeout_s)

    def update(self, batch: Batch, timings: dict[str, float]) -> dict[str, float] | None:
        """The step's update (compute_update) on every rank; None: it raised, and `failed_step` sent its
        groups back (one rank; across ranks a failure ends the run)."""
        cfg, state = self.cfg, self.state
        if self.ranks is not None:
            ranks = self.ranks

            def update() -> dict[str, float]:
                ranks.send(train_order(batch.groups, cfg, state.step + 1))
                return compute_update(
                    self.engine, batch, cfg, self.pad_id, state.step + 1, self.reference, timings, ranks
                )

            return self.collective(f"step {state.step + 1}", update)
        try:
            return compute_update(
                self.engine, batch, cfg, self.pad_id, state.step + 1, self.reference, timings
            )
        except Exception as exc:  # a bad batch must cost its step, not the process (and every restart)
            self.guard.failed_step(batch, exc)
            return None

    def _top_sparks(self, batch: Batch) -> dict[str, int]:
        top: dict[str, int] = {}
        for token_id, count in spark_tokens(batch.groups).most_common(TOP_SPARKS):
            text = self.tokenizer.decode([token_id])  # two ids may decode alike: their counts add up
            top[text] = top.get(text, 0) + count
        return top

    def collective(self, what: str, run: Callable[[], T]) -> T:
        """`run` a part every learner rank takes part in; any failure ends the run (`rank_lost`), as
        RankLost naming what to do. One rank: just `run`."""
        if self.ranks is None:
            return run()
        try:
            return run()
        except Exception as exc:
            error = lost(what, exc, self.ledger.saved_step)
            self.rank_lost = str(error)
            log.error("%s", error)
            raise error from exc

    def full_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the weights to publish; under ZeRO-3 across ranks, every rank gathers."""
        if self.ranks is None or self.cfg.zero_stage != 3:
            return cpu_weights(self.engine)
        ranks = self.ranks

        def gather() -> dict[str, torch.Tensor]:
            ranks.send(RankOrder(kind="gather"))
            return cpu_weights(self.engine)

        return self.collective("gathering the weights", gather)

    def release_ranks(self) -> None:
        """The other ranks may exit: the run is over (nothing to tell once one is lost)."""
        if self.ranks is not None and self.rank_lost is None:
            ranks = self.ranks
            try:
                self.collective("the stop", lambda: ranks.send(RankOrder(kind="stop")))
            except RankLost:
                return  # logged: the process exits non-zero
            torch.distributed.destroy_process_group()  # now, not at interpreter exit (see follower.py)

    def _order_save(self, path: Path) -> None:
        if self.ranks is not None:
            self.ranks.send(RankOrder(kind="save", path=str(path)))

    def checkpoint(self, tag: str | None) -> Path:
        """Write a checkpoint, then trim the journal up to it. Raises CheckpointError, trimming nothing:
        the journal must keep every step since the last checkpoint that was written."""
        previous = self.reporter.report.phase
        self.reporter.update(phase="checkpointing")
        self.state.hparam_overrides = dict(self.control.overrides)
        try:
            path = self.collective(
                "the checkpoint",
                lambda: save_checkpoint(
                    self.engine,
                    self.tokenizer,
                    self.run_dir,
                    self.state,
                    self.cfg.keep_checkpoints,
                    tag,
                    before_save=self._order_save,
                ),
            )
        except CheckpointError:
            self.metrics.checkpoint_failures.inc()
            raise
        finally:
            self.reporter.update(phase=previous)
        self.ledger.checkpointed(self.state.step)
        self.metrics.checkpoints.inc()
        self.reporter.update(last_checkpoint=str(path))
        return path

    def checkpoint_or_log(self) -> None:
        """A periodic checkpoint; one that cannot be written costs a line, and the next one retries."""
        try:
            self.checkpoint(None)
        except CheckpointError as exc:
            log.error(
                "%s; training goes on: the journal keeps the %d steps since step %d, the next checkpoint "
                "retries",
                exc,
                self.state.step - self.ledger.saved_step,
                self.ledger.saved_step,
            )
