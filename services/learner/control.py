"""The learner's side of the control plane: commands applied at step boundaries, each answered.

pause / resume and `set_hparams` are applied here; checkpoint and stop need the engine and the loop, so
they are handed back (`Boundary`) and answered by the loop once done. A hyperparameter change is checked
against the settings models and applied all or nothing; the learning rate goes into the optimizer too.
Changes accumulate in `overrides`, which the checkpoint keeps, so a resumed run goes on with them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from deepspeed import DeepSpeedEngine

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
    """What the loop must still do at this step boundary (control applied the rest itself)."""

    checkpoints: list[ControlCommand] = field(default_factory=list)
    stop: ControlCommand | None = None


def set_lr(engine: DeepSpeedEngine, lr: float) -> None:
    # DeepSpeed's optimizers (ZeRO, bf16) promote the torch optimizer's param_groups for exactly this.
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


def hparams_in_force(
    engine: DeepSpeedEngine, cfg: LearnerSettings, groups: Sequence[TrajectoryGroup] = ()
) -> dict[str, HparamValue]:
    """The learner's hyperparameters, with `lr` read back from the optimizer: what the step really used;
    with `groups`, also the sampling they were made with (`temperature`, `top_p`: the workers' live values,
    the most common when a change splits the step), so a live change of either shows in the step rows."""
    values = learner_hparams(cfg)
    lrs = engine.get_lr()
    if lrs:
        values["lr"] = float(lrs[0])
    if groups:
        for name in ("temperature", "top_p"):
            made_with = Counter(getattr(g.sampling, name) for g in groups)
            values[name] = made_with.most_common(1)[0][0]
    return values


class LearnerControl:
    """Applies the control stream to the learner's settings and engine. The loop's thread only."""

    reader: ControlReader
    cfg: LearnerSettings
    engine: DeepSpeedEngine
    paused: bool
    overrides: dict[str, HparamValue]
    on_result: Callable[[CommandResult], None]
    last_change: LiveChange | None

    def __init__(
        self,
        reader: ControlReader,
        cfg: LearnerSettings,
        engine: DeepSpeedEngine,
        overrides: dict[str, HparamValue],
        on_result: Callable[[CommandResult], None],
    ) -> None:
        """`overrides`: live changes a resumed checkpoint carries; re-applied before the first step."""
        self.reader, self.cfg, self.engine, self.on_result = reader, cfg, engine, on_result
        self.overrides = {}
        self.last_change = LiveChange(dict(overrides), None) if overrides else None
        if overrides:
            log.info("re-applying live hyperparameter changes from the checkpoint: %s", overrides)
        for name, value in overrides.items():
            try:  # one by one: a change that no longer fits (another loss, new bounds) blocks nothing else
                self._apply({name: value})
            except HparamError as exc:
                log.warning("not re-applying %s=%r from the checkpoint: %s", name, value, exc)
        self.paused = reader.initial_state().paused
        if self.paused:
            log.warning("starting paused: the fleet's control state says paused (`sparkrl resume` goes on)")

    def pending(self) -> bool:
        """A command is waiting: the loop should come to a boundary."""
        return self.reader.pending()

    def boundary(self, step: int) -> Boundary:
        """Apply what can be applied now; hand back checkpoints and a stop."""
        todo = Boundary()
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
                self._set_hparams(command, step)
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

    def _set_hparams(self, command: ControlCommand, step: int) -> None:
        mine, _ = split(command.body.values)  # type: ignore[union-attr]  (set_hparams)
        if not mine:
            return  # only worker values: not ours to answer
        try:
            applied = self._apply(mine)
        except HparamError as exc:
            self.answer(command, "rejected", str(exc), step)
            return
        self.last_change = LiveChange(applied, step)
        self.answer(command, "applied", f"in force from step {step + 1}", step, applied)

    def forget(self, change: LiveChange) -> None:
        """Keep `change` out of the next checkpoint, so that a resume trains with the configured values
        (it is still in force in this process)."""
        for name in change.values:
            self.overrides.pop(name, None)

    def _apply(self, values: dict[str, HparamValue]) -> dict[str, HparamValue]:
        applied = apply_learner(self.cfg, values)
        if "lr" in applied:
            set_lr(self.engine, float(applied["lr"]))
        self.overrides |= applied
        return applied
