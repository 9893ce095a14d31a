"""The learner's loop: fill → update → commit → publish → report, between control boundaries.

Words, one per concept:

- **group**: the completions of one prompt, with their rewards (a `TrajectoryGroup` off the stream).
- **batch**: the groups one step trains on (`learner.prompts_per_step`, more when a burst would go stale).
- **step**: one batch trained and committed, ending in one new version; counted from 1. The step is the
  unit of the run's files: `step` in `metrics.jsonl`, `checkpoints/step-N`, `journal/step-N.bin`.
- **version**: what the learner publishes: the weights after a step (`policy_version`). A worker tags
  every token it samples with the version it held; staleness is counted in versions.
- **update**: one optimizer step. A step takes `learner.updates_per_rollout` of them (one by default),
  each over one **mini-batch** of its groups (update.py).
- **micro-batch**: one forward/backward, as many padded rows as `learner.micro_batch_tokens` holds.
- **turn**: one pass of this loop: a control boundary, then a step or a paused wait.
- **rank**: one process of a data-parallel learner (`learner.ranks`); the trainer hides how many.

The parts: a *trainer* (trainer.py, ranks.py: one rank or N; `update`, `weights`, `save`), the *ledger*
(ledger.py: exactly-once — journal → trained marks → ack → checkpoint trim), the *collector*
(collect.py: the next batch off the stream), the *fleet* (fleet.py: the publisher and what the workers
hold), *control* (control.py: commands applied at the boundary), the *guard* (guard.py: a step that
raises or is not finite) and the *reports* (reporting.py). Groups are acknowledged only after the step
that used them; a pause keeps the groups in hand and reads no more.

The live hyperparameters are one frozen value, `live` (the learner's settings in force): control's
boundary returns the next one, and the loop hands it to every part that reads a live value, as an
argument (the update sets the optimizer's lr from it, once per step; the collector and the fleet check
take its `max_staleness`). No part keeps a copy that a change would have to reach.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from sparkrl.proto import ControlCommand, StepMetrics
from sparkrl.services.common.ownership import Fence, Fenced
from sparkrl.services.common.settings import LearnerSettings
from sparkrl.services.learner.checkpoint import (
    CheckpointError,
    drop_overrides,
    latest_checkpoint,
    nonfinite_tensors,
)
from sparkrl.services.learner.collect import BatchCollector
from sparkrl.services.learner.control import LearnerControl, hparams_in_force
from sparkrl.services.learner.disk import failed_write, short_of_space
from sparkrl.services.learner.fleet import Fleet
from sparkrl.services.learner.guard import StepGuard, broken_start, final_checkpoint_failed
from sparkrl.services.learner.ledger import Batch, Ledger
from sparkrl.services.learner.ranks import RankLost
from sparkrl.services.learner.reporting import Reports, StepTaken, write_ended
from sparkrl.services.learner.state import TrainState
from sparkrl.services.learner.stats import Updated
from sparkrl.services.learner.trainer import Trainer

log = logging.getLogger("sparkrl.learner")

PAUSED_POLL_S = 0.2  # how often a paused learner looks at the control stream


@dataclass(frozen=True)
class Ending:
    """How the loop ended, for `close` (and `ended.json`)."""

    reason: str | None = None  # a normal end: learner.max_steps reached, the data ran out
    command: ControlCommand | None = None  # the stop command that ended it (answered at close)
    crashed: str | None = None  # an exception out of the loop, or out of the start


class Clock:
    """Seconds by part, `timed` into a dict that travels with the step (`time/<part>_s` in its row)."""

    def __init__(self, *parts: str) -> None:
        self.seconds = dict.fromkeys(parts, 0.0)

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        mark = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - mark

    def take(self) -> dict[str, float]:
        """The seconds so far; the clock starts again from zero."""
        seconds, self.seconds = self.seconds, dict.fromkeys(self.seconds, 0.0)
        return seconds


@dataclass
class Learner:
    """The loop's parts, built once (`service.assemble`); `run` is the loop itself."""

    live: LearnerSettings  # in force: replaced (never changed) at each control boundary
    run_dir: Path
    state: TrainState
    trainer: Trainer
    ledger: Ledger
    collector: BatchCollector
    fleet: Fleet
    control: LearnerControl
    guard: StepGuard
    reports: Reports
    stop: threading.Event  # set by whoever owns the signals: the run ends at the next boundary
    uncommitted: str | None = None  # why the weights in hand hold a step no commit recorded: never saved
    fence: Fence | None = None  # the run directory's owner check, before every checkpoint and ended.json

    def run(self) -> Ending:
        """Turn until the run is over: the control boundary, then a step or a paused wait."""
        waited = Clock("wait_data", "wait_fleet")  # since the last step, for its row
        self.collector.start_read_ahead()
        try:
            while (ending := self.over()) is None:
                todo = self.control.boundary(self.state.step, self.live)
                self.live = todo.live
                for command in todo.checkpoints:
                    self.checkpoint_command(command)
                if todo.stop is not None:
                    return Ending(command=todo.stop)
                if self.control.paused:  # a paused run writes nothing: the version in flight lands first
                    self.fleet.drain()
                self.reports.turn(self.control.paused, hparams_in_force(self.trainer.lr(), self.live))
                if self.control.paused:
                    self.idle()
                    continue
                max_staleness = self.live.max_staleness
                with waited.timed("wait_fleet"):
                    in_reach = self.fleet.in_reach(
                        self.state.policy_version,
                        max_staleness,
                        partial(self.collector.read_ahead, max_staleness=max_staleness),
                        self.interrupted,
                    )
                if not in_reach:
                    continue  # a command came in: to the boundary first
                with waited.timed("wait_data"):
                    batch = self.collector.fill(self.state.policy_version, max_staleness, self.interrupted)
                if batch is not None:
                    self.step(batch, waited.take())
            return ending
        except RankLost:
            return Ending()  # the trainer keeps why (`lost`); logged, the run ends non-zero

    def over(self) -> Ending | None:
        """Why the run is over, once it is: a signal, a guard rail or a lost rank (their reasons are kept
        where they were found), learner.max_steps, or the data ran out (after its last, partial step)."""
        cfg = self.live
        if self.guard.stop is None and (short := short_of_space(self.run_dir, cfg.min_free_mb)) is not None:
            log.error("%s", short)
            self.guard.stop = short  # ends the run non-zero, with this reason
            self.reports.disk_failure(short)
        if self.stop.is_set() or self.trainer.lost or self.guard.stop:
            return Ending()
        if cfg.max_steps is not None and self.state.step >= cfg.max_steps:
            return Ending(reason=f"learner.max_steps ({cfg.max_steps}) reached")
        if self.collector.exhausted is not None and not self.collector.groups:
            return Ending(reason=self.collector.exhausted)
        return None

    def step(
        self, batch: Batch, waited: dict[str, float] | None = None, journaled: bool = False
    ) -> StepMetrics | None:
        """One step: update → commit → publish → report (→ checkpoint); its row. `waited`: the seconds
        spent waiting for the fleet and the data since the last step. `journaled`: a replay.
        None: no step was taken (it raised, none of its updates was applied, or its weights are not
        finite: then `guard.stop` says why the run must end)."""
        state, clock, started, live = self.state, Clock(), time.monotonic(), self.live
        updated = self.update(batch, journaled, live)
        if updated is None:
            return None
        batch, done = updated
        with clock.timed("copy_weights"):
            weights = self.trainer.weights()
        if not self.guard.publishable(weights, self.ledger.saved_step):
            return None
        with clock.timed("bookkeeping"):
            acked = self.commit(batch, journaled) + self.collector.take_acked()
        with clock.timed("publish"):  # the broadcast runs on the publisher's thread
            self.fleet.publish(state.policy_version, weights, adapter_base=self.trainer.adapter_base)
        if state.step == live.max_steps:
            self.fleet.settle(state.policy_version)
        hparams = hparams_in_force(self.trainer.lr(), live, batch.groups)  # the lr the update set
        timings = (waited or {}) | done.seconds | clock.seconds
        took = StepTaken(batch, done.row(), time.monotonic() - started, timings, hparams, acked)
        row = self.reports.step(took, state, self.fleet.last_sync, live)
        if state.step % live.checkpoint_every == 0:
            self.checkpoint_or_log()
        return row

    def commit(self, batch: Batch, journaled: bool) -> int:
        """The ledger's commit, which counts the step only once it returned (commit before count). If it
        raises, the weights hold an update no ledger records: `uncommitted` says so, and they are never
        checkpointed (a resume redoes the step from the journal, or its groups come again)."""
        try:
            return self.ledger.commit(self.state, batch, journaled)
        except BaseException as exc:
            if isinstance(exc, OSError):  # the journal's write: a full disk, on the status and the page
                what = f"the journal of step {self.state.step + 1}"
                self.reports.disk_failure(failed_write(what, self.run_dir, exc))
            self.uncommitted = (
                f"step {self.state.step + 1} was not committed ({type(exc).__name__}: {exc}), so its update "
                f"is in no checkpoint: `--resume` goes on from step {self.ledger.saved_step} and its journal"
            )
            raise

    def update(self, batch: Batch, journaled: bool, live: LearnerSettings) -> tuple[Batch, Updated] | None:
        """The step's updates under `live`: (the part of `batch` they trained, what they did); None when
        they trained nothing (the guard sent the groups back, or dead-lettered them)."""
        try:
            updated = self.trainer.update(batch, self.state.step + 1, live)
        except RankLost:
            raise
        except Exception as exc:  # a bad batch must cost its step, not the process (and every restart)
            self.guard.failed_step(batch, exc, live)
            return None
        trained = self.guard.checked(batch, updated, journaled, live)
        return None if trained is None else (trained, updated)

    def replay(self) -> int:
        """Redo the steps the journal holds after the checkpoint, in order, as the same steps: their
        groups were acknowledged, so only this makes the resumed model reflect them. Returns how many."""
        replayed = 0
        for step, batch in self.ledger.replay(self.state.step):
            log.info("replaying step %d from the journal (%d groups)", step, len(batch.entries))
            if self.step(batch, {"wait_data": 0.0, "wait_fleet": 0.0}, journaled=True) is None:
                raise RuntimeError(
                    f"replaying step {step} from {self.ledger.journal.path(step)} failed; see above"
                )
            replayed += 1
        if replayed:
            log.info("replayed %d steps from the journal: the model reflects them again", replayed)
        return replayed

    def publish_first(self, broadcast: bool, source: str) -> None:
        """The version the learner starts from: announced (a fresh run's version 0 is the model every
        worker loaded already) or, resumed, broadcast. Weights `source` left not finite stop the start."""
        weights = self.trainer.weights()
        if names := nonfinite_tensors(weights):  # a checkpoint or model that was saved broken
            self.guard.weights_broken = True
            self.guard.stop = broken_start(names, self.state.step, source)
            raise RuntimeError(self.guard.stop)
        self.fleet.publish(
            self.state.policy_version, weights, broadcast=broadcast, adapter_base=self.trainer.adapter_base
        )

    def interrupted(self) -> bool:
        self.ledger.rebuild_if_wiped()  # between reads: before the next group's trained mark is looked up
        return self.stop.is_set() or self.control.pending()

    def idle(self) -> None:
        """A paused turn: the groups in hand are kept (alive), none is read."""
        self.ledger.rebuild_if_wiped()
        self.collector.keep_alive()
        self.stop.wait(PAUSED_POLL_S)

    def checkpoint(self, tag: str | None) -> Path:
        """Write a checkpoint, then let the ledger trim the journal up to it. Raises CheckpointError,
        trimming nothing: the journal must keep every step since the last checkpoint that was written."""
        if self.fence is not None:  # a newer learner of this run holds the directory: write nothing
            self.fence.check(f"the checkpoint of step {self.state.step}")
        with self.reports.checkpointing():  # a failure goes on the page and into the next step's row
            self.state.hparam_overrides = dict(self.control.overrides)
            try:
                path = self.trainer.save(self.state, tag)
            except CheckpointError:
                self.state.checkpoint_failures += 1
                raise
        self.ledger.checkpointed(self.state.step)
        self.reports.checkpointed(path)
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

    def checkpoint_command(self, command: ControlCommand) -> None:
        """A checkpoint command, answered with the checkpoint or why it could not be written."""
        try:
            path = self.checkpoint(command.body.tag)  # type: ignore[union-attr]
        except CheckpointError as exc:
            log.error("%s (a checkpoint command); training goes on", exc)
            self.reports.published()  # the failure on the status before the answer
            self.control.answer(command, "rejected", str(exc), self.state.step)
            return
        self.reports.published()  # last_checkpoint on the status before the answer
        self.control.answer(command, "applied", f"checkpoint {path}", self.state.step)

    def close(self, ending: Ending) -> str | None:
        """The final checkpoint first (disk only, before anything that may wait on the network), then the
        stop command's answer and the last broadcast. `ended.json` says why the run ended. Returns why it
        ends non-zero (None: it does not)."""
        state, command, guard = self.state, ending.command, self.guard
        self.collector.stop_read_ahead()  # what it holds stays pending: the next learner takes it
        fenced = self.fenced()
        keep = fenced is None and (command is None or command.body.checkpoint)  # type: ignore[union-attr]
        # Never a checkpoint the ranks cannot all write, nor one of weights that are not finite, nor one of
        # weights ahead of the ledger (a step whose commit failed).
        keep = keep and self.trainer.lost is None and not guard.weights_broken and self.uncommitted is None
        causes = [w for w in (self.trainer.lost, ending.crashed, guard.stop, self.uncommitted, fenced) if w]
        final_failed = self.final_checkpoint() if keep and state.step > self.ledger.saved_step else None
        keep = keep and final_failed is None
        suspect, latest = guard.suspect, latest_checkpoint(self.run_dir)
        if suspect is not None and latest is not None and fenced is None:
            try:
                drop_overrides(latest, list(suspect.values))  # an older checkpoint may carry it
            except OSError as exc:
                log.warning("%s still carries %s: %s", latest, suspect.describe(), exc)
        self.trainer.close()
        self.reports.phase("stopping")
        if command is not None:
            where = f"; checkpoint {self.reports.last_checkpoint}" if keep else ""
            self.control.answer(command, "applied", f"stopped at step {state.step}{where}", state.step)
        self.fleet.close()
        final = [final_failed] if final_failed else []
        normal = ending.reason or ("a stop command" if command is not None else "stopped (signal)")
        ended = "; then ".join(causes + final if causes else [normal, *final])
        if fenced is None:  # an orphan's ending is not the run's: the newer learner writes that
            write_ended(self.run_dir, ended, state.step, self.collector.counts)
        self.reports.close()
        log.info(
            "learner stopped at step %d (policy version %d): %s", state.step, state.policy_version, ended
        )
        return "; then ".join(causes + final) or None

    def fenced(self) -> str | None:
        """Why this learner may write nothing more into the run directory (a newer one holds it), or None."""
        try:
            if self.fence is not None:
                self.fence.check("the final checkpoint or ended.json")
        except Fenced as exc:
            log.error("%s", exc)
            return str(exc)
        return None

    def final_checkpoint(self) -> str | None:
        """The run's last checkpoint; why it failed, if it did (a lost rank is not its failure)."""
        try:
            self.checkpoint(None)
        except RankLost:
            log.warning("no final checkpoint: the learner's ranks cannot all write theirs (see above)")
        except Exception as exc:  # a disk full or gone (CheckpointError), or DeepSpeed's own error
            why = final_checkpoint_failed(exc, self.state.step, self.ledger.saved_step)
            log.error("%s", why, exc_info=not isinstance(exc, CheckpointError))
            return why
        return None
