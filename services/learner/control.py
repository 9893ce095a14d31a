"""The learner's side of the control plane: commands applied at step boundaries, each answered.

pause / resume and `set_hparams` are applied here; checkpoint and stop need the engine and the loop, so
they are handed back (`Boundary`) and answered by the loop once done. A hyperparameter change is checked
against the settings models and applied all or nothing, as new settings: the boundary returns the
learner's settings in force (`Boundary.live`), which the loop hands to the next step. Nothing here
touches the optimizer: the update sets its learning rate from those settings, once per step.
Changes accumulate in `overrides`, which the checkpoint keeps, so a resumed run goes on with them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sparkrl.proto import CommandResult, ControlCommand, HparamValue, TrajectoryGroup
from sparkrl.services.common.control_channel import ControlReader
from sparkrl.services.common.settings import LearnerSettings
from sparkrl.services.common.settings.hparams import HparamError, apply_learner, learner_hparams, split

log = logging.getLogger("sparkrl.learner.control")


@dataclass(frozen=True)
class LiveChange:
    """The last hyperparameter change applied: the first suspect when steps stop being finite."""

    values: dict[str, HparamValue]
    step: int | None  # the boundary it was applied at; None: re-applied from the checkpoint at start

    def describe(self) -> str:
        where = f"at step {self.step}" if self.step is not None else "re-applied from the checkpoint"
        return ", ".join(f"{name}={value}" for name, value in self.values.items()) + f" ({where})"


@dataclass
class Boundary:
    """The learner's settings in force after this step boundary, and what the loop must still do at it
    (control applied the rest itself)."""

    live: LearnerSettings
    checkpoints: list[ControlCommand] = field(default_factory=list)
    stop: ControlCommand | None = None


def hparams_in_force(
    lr: float | None, cfg: LearnerSettings, groups: Sequence[TrajectoryGroup] = ()
) -> dict[str, HparamValue]:
    """The learner's hyperparameters in `cfg`, with `lr` the optimizer's (`Trainer.lr()`: what the last
    update really used, the schedule's factor included; None: keep `cfg`'s); with `groups`, also the
    sampling they were made with (`temperature`, `top_p`: the workers' live values, the most common when
    a change splits the step), so a live change of either shows in the step rows."""
    values = learner_hparams(cfg)
    if lr is not None:
        values["lr"] = lr
    if groups:
        for name in ("temperature", "top_p"):
            made_with = Counter(getattr(g.sampling, name) for g in groups)
            values[name] = made_with.most_common(1)[0][0]
    return values


def resumed(
    cfg: LearnerSettings, overrides: dict[str, HparamValue]
) -> tuple[LearnerSettings, dict[str, HparamValue]]:
    """The settings a run starts with: `cfg` with the live changes its checkpoint carries (`overrides`),
    each on its own, so that one that no longer fits (another loss, new bounds) blocks nothing else;
    (those settings, the changes re-applied)."""
    live = cfg
    applied: dict[str, HparamValue] = {}
    if overrides:
        log.info("re-applying live hyperparameter changes from the checkpoint: %s", overrides)
    for name, value in overrides.items():
        try:
            live, one = apply_learner(live, {name: value})
        except HparamError as exc:
            log.warning("not re-applying %s=%r from the checkpoint: %s", name, value, exc)
            continue
        applied |= one
    return live, applied


class LearnerControl:
    """Answers the control stream at the learner's step boundaries. The loop's thread only."""

    reader: ControlReader
    paused: bool
    overrides: dict[str, HparamValue]
    on_result: Callable[[CommandResult], None]
    last_change: LiveChange | None

    def __init__(
        self,
        reader: ControlReader,
        overrides: dict[str, HparamValue],
        on_result: Callable[[CommandResult], None],
    ) -> None:
        """`overrides`: the live changes a resumed checkpoint carried and `resumed` re-applied."""
        self.reader, self.on_result = reader, on_result
        self.overrides = dict(overrides)
        self.last_change = LiveChange(dict(overrides), None) if overrides else None
        self.paused = reader.initial_state().paused
        if self.paused:
            log.warning("starting paused: the fleet's control state says paused (`sparkrl resume` goes on)")

    def pending(self) -> bool:
        """A command is waiting: the loop should come to a boundary."""
        return self.reader.pending()

    def boundary(self, step: int, live: LearnerSettings) -> Boundary:
        """Apply what can be applied now to `live`, the settings in force; hand back the new settings,
        the checkpoints and a stop."""
        todo = Boundary(live)
        for command in self.reader.poll():
            name = command.body.command
            if name == "checkpoint":
                todo.checkpoints.append(command)
            elif name == "stop":
                todo.stop = command
            elif name == "pause":
                self.paused = True
                self.answer(command, "applied", f"paused at step {step}", step)
            elif name == "resume":
                was = self.paused
                self.paused = False
                self.answer(command, "applied", f"resumed at step {step}" if was else "was not paused", step)
            else:
                todo.live = self._set_hparams(command, step, todo.live)
        return todo

    def answer(
        self,
        command: ControlCommand,
        outcome: str,
        detail: str,
        step: int,
        values: dict[str, HparamValue] | None = None,
    ) -> None:
        self.on_result(self.reader.answer(command, outcome, detail, step=step, values=values))

    def _set_hparams(self, command: ControlCommand, step: int, live: LearnerSettings) -> LearnerSettings:
        """`live` with the command's learner values, or as it was when they are rejected (or none)."""
        mine, _ = split(command.body.values)  # type: ignore[union-attr]  (set_hparams)
        if not mine:
            return live  # only worker values: not ours to answer
        try:
            live, applied = apply_learner(live, mine)
        except HparamError as exc:
            self.answer(command, "rejected", str(exc), step)
            return live
        self.overrides |= applied
        self.last_change = LiveChange(applied, step)
        self.answer(command, "applied", f"in force from step {step + 1}", step, applied)
        return live

    def forget(self, change: LiveChange) -> None:
        """Keep `change` out of the next checkpoint, so that a resume trains with the configured values
        (it is still in force in this process)."""
        for name in change.values:
            self.overrides.pop(name, None)
