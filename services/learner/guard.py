"""The learner's guard rails: what becomes of a step that raises or whose numbers are not finite, and
what the learner says when the run must stop for it or when its final checkpoint cannot be written.

- A step that raises costs its step: its groups go back, and one that fails alone (or twice) is
  dead-lettered with the error.
- An update whose loss or gradient norm is not finite is not applied (update.py drops its gradients);
  the groups it would have trained go back, but a group whose loss alone is not finite is dead-lettered.
  `learner.max_nonfinite_steps` such steps in a row stop the run: the model or a hyperparameter went
  wrong, not the data, and going on would only burn the data set.
- Weights holding a NaN or an infinity are never published, journaled or checkpointed: the run stops.
- A checkpoint that cannot be written costs one line, not the run: the journal keeps every step since
  the last checkpoint that was written, and the next one retries. Only the final one ends the run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from sparkrl.proto import TrajectoryGroup
from sparkrl.services.common.bus import Entry, RedisBus
from sparkrl.services.common.settings import LearnerSettings
from sparkrl.services.learner.checkpoint import CheckpointError, nonfinite_tensors
from sparkrl.services.learner.collect import BatchCollector
from sparkrl.services.learner.control import LearnerControl, LiveChange
from sparkrl.services.learner.ledger import Batch
from sparkrl.services.learner.metrics import LearnerMetrics
from sparkrl.services.learner.state import TrainState
from sparkrl.services.learner.stats import NotApplied, Updated
from sparkrl.services.learner.trainer import Trainer
from sparkrl.services.learner.update import split_applied

log = logging.getLogger("sparkrl.learner")

NOT_FINITE_ALONE = (
    "its loss alone is not finite under the current weights (log-probs or rewards far out of range)"
)


@dataclass
class Streak:
    """Steps in a row with an update not applied, against the limit that stops the run."""

    limit: int
    count: int = 0

    def add(self) -> bool:
        """One more; True once the limit is reached."""
        self.count += 1
        return self.count >= self.limit

    def reset(self) -> None:
        self.count = 0


def likely_cause(change: LiveChange | None) -> str:
    if change is None:
        return (
            "no hyperparameter was changed live, so look at the model's numerics (learner.dtype, "
            "learner.autocast) and at the last groups (RUN_DIR/samples.jsonl)"
        )
    return (
        f"likely the last live change, {change.describe()}; the checkpoints no longer carry it, so a "
        "resume trains with the configured values"
    )


def skipped_line(step: int, update: NotApplied, back: int, streak: Streak) -> str:
    """The error line of one update not applied."""
    return (
        f"step {step}: loss {update.loss}, gradient norm {update.grad_norm}: not finite, the update is not "
        f"applied (its gradients are dropped; {back} groups go back); {streak.count} in a row, the run "
        f"stops at {streak.limit} (learner.max_nonfinite_steps)"
    )


def nonfinite_stop(streak: Streak, step: int, change: LiveChange | None) -> str:
    """Why the run stops after `learner.max_nonfinite_steps` steps in a row were not applied."""
    return (
        f"{streak.count} steps in a row had a loss or gradient norm that is not finite "
        f"(learner.max_nonfinite_steps={streak.limit}); none was applied, so the weights are those of step "
        f"{step} and nothing non-finite was published; their groups were not acknowledged. Cause: "
        f"{likely_cause(change)}"
    )


def broken_weights_stop(names: list[str], step: int, saved_step: int, change: LiveChange | None) -> str:
    """Why the run stops when the weights after a step are not finite."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    since = f"step {saved_step}'s checkpoint and the journal after it" if saved_step else "the journal"
    return (
        f"the weights after step {step} are not finite ({shown}): not published, journaled or "
        f"checkpointed, and that step's groups were not acknowledged; `--resume` goes on from {since}. "
        f"Cause: {likely_cause(change)}"
    )


def broken_start(names: list[str], step: int, source: str) -> str:
    """Why the learner does not start: the weights it loaded are not finite."""
    return (
        f"the weights loaded from {source} (step {step}) are not finite ({', '.join(names[:3])}): nothing "
        "was published. Resume from an earlier checkpoint (write its folder's name into "
        "RUN_DIR/checkpoints/latest) or start from a sound model"
    )


def final_checkpoint_failed(error: Exception, step: int, saved_step: int) -> str:
    """Why the run ends non-zero when its final checkpoint cannot be written, and the fix."""
    kept = (
        f"step {saved_step}'s checkpoint and the journal after it hold" if saved_step else "the journal holds"
    )
    if isinstance(error, CheckpointError):
        what, fix = str(error), "make RUN_DIR/checkpoints a writable directory with room for a checkpoint"
    else:
        what, fix = f"{type(error).__name__}: {error}", "mend what the error names (learner.log)"
    return (
        f"the final checkpoint (step {step}) failed: {what}. Nothing is lost: {kept} every step "
        f"(RUN_DIR/journal). Fix: {fix}, then `sparkrl up --resume` (or `sparkrl learner --resume`)"
    )


@dataclass
class StepGuard:
    """The learner's part that handles a step gone wrong; `stop` says why the run must end, once so.
    The trainer probes groups alone (on one rank only: under ZeRO-3 across ranks a forward is a
    collective, and a step that raises ends the run)."""

    trainer: Trainer
    bus: RedisBus
    collector: BatchCollector
    control: LearnerControl
    metrics: LearnerMetrics
    state: TrainState
    streak: Streak
    failures: dict[str, int] = field(default_factory=dict)  # group id → failed steps it was in
    stop: str | None = None  # why the run must end non-zero
    weights_broken: bool = False  # the engine's weights are not finite: never checkpoint them
    suspect: LiveChange | None = None  # the live change blamed for `stop`, kept out of the checkpoints

    def failed_step(self, batch: Batch, error: Exception, cfg: LearnerSettings) -> None:
        """A step under `cfg` (the settings in force) raised: the process stays up, its groups go back. A
        group that fails its own probe (a forward pass of it alone), or a second step, is dead-lettered by
        itself with the error."""
        log.exception("step %d failed on %d groups; probing each", self.state.step + 1, len(batch.groups))
        self.metrics.step_failures.inc()
        reason = f"{type(error).__name__}: {error}"[:1500]
        back: tuple[list[TrajectoryGroup], list[Entry]] = ([], [])
        for group, entry in zip(batch.groups, batch.entries, strict=True):
            self.failures[group.group_id] = self.failures.get(group.group_id, 0) + 1
            probe = self.trainer.probe(group, cfg)
            if probe is not None or self.failures[group.group_id] >= 2:
                why = f"fails alone: {probe}" if probe else f"failed two training steps, last: {reason}"
                self.metrics.dead_lettered.inc(self.bus.dead_letter("trajectories", entry, why))
                continue
            back[0].append(group)
            back[1].append(entry)
        self.collector.give_back(*back)

    def checked(self, batch: Batch, updated: Updated, journaled: bool, cfg: LearnerSettings) -> Batch | None:
        """The part of `batch` the step's applied updates (under `cfg`) trained: all of it when each was
        applied (the streak of steps not applied ends), else what `not_applied` leaves; None when nothing
        was trained."""
        if updated.not_applied is not None:
            return self.not_applied(batch, updated.applied, updated.not_applied, journaled, cfg)
        self.streak.reset()
        self.metrics.nonfinite_in_a_row.set(0)
        return batch

    def not_applied(
        self, batch: Batch, applied: int, update: NotApplied, journaled: bool, cfg: LearnerSettings
    ) -> Batch | None:
        """An update of the step was not applied (`update`), after `applied` were: its loss or gradient
        norm was not finite. The groups no applied update trained go back, but one whose loss alone is not
        finite is dead-lettered; a step without such a culprit counts toward `learner.max_nonfinite_steps`.
        Returns the part that was trained (to commit), None when none was. `journaled`: a replay, whose
        groups cannot go back."""
        trained, left = split_applied(batch.groups, cfg, applied)
        self.state.nonfinite_skipped += 1
        self.metrics.nonfinite_skipped.inc()
        if journaled:
            log.error("%s", skipped_line(self.state.step + 1, update, 0, self.streak))
            return None
        culprits = self.culprits([batch.groups[i] for i in left], cfg)
        for i in (left[n] for n in culprits):
            self.metrics.dead_lettered.inc(
                self.bus.dead_letter("trajectories", batch.entries[i], NOT_FINITE_ALONE)
            )
        back = [i for n, i in enumerate(left) if n not in culprits]
        self.collector.give_back([batch.groups[i] for i in back], [batch.entries[i] for i in back])
        if not culprits and self.streak.add():
            self.stop = nonfinite_stop(self.streak, self.state.step, self.blame())
        self.metrics.nonfinite_in_a_row.set(self.streak.count)
        log.error("%s", skipped_line(self.state.step + 1, update, len(back), self.streak))
        if self.stop is not None:
            log.error("the run stops: %s", self.stop)
        if not trained:
            return None
        groups, entries = [batch.groups[i] for i in trained], [batch.entries[i] for i in trained]
        return Batch(groups, entries, batch.dropped_stale, batch.staleness_mean, batch.filtered)

    def blame(self) -> LiveChange | None:
        """The last live change, kept out of every checkpoint from now on (service.close also takes it
        out of the latest one): a resume must not re-apply what likely broke the run."""
        self.suspect = self.control.last_change
        if self.suspect is not None:
            self.control.forget(self.suspect)
        return self.suspect

    def culprits(self, groups: list[TrajectoryGroup], cfg: LearnerSettings) -> set[int]:
        """Which of `groups` give a loss that is not finite on their own, when the others do not (all or
        none: the model, or the gradient, is what overflows)."""
        if len(groups) < 2:
            return set()
        bad = {n for n, group in enumerate(groups) if not self.trainer.finite_alone(group, cfg)}
        return bad if len(bad) < len(groups) else set()

    def publishable(self, weights: dict[str, torch.Tensor], saved_step: int) -> bool:
        """Weights holding a NaN or an infinity are never published (nor journaled nor checkpointed):
        the run stops, and the step's groups stay unacknowledged for the resume."""
        names = nonfinite_tensors(weights)
        if not names:
            return True
        self.weights_broken = True
        self.stop = broken_weights_stop(names, self.state.step + 1, saved_step, self.blame())
        log.error("the run stops: %s", self.stop)
        return False
