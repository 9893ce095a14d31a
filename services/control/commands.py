"""Issuing control commands: decide who must answer, record the fleet's desired state, append the command
to the control stream, and wait for every target's `CommandResult`.

Nothing is sent when a target is missing (409) or a value is out of bounds (422); a target that stops
heartbeating while we wait is reported as `gone`, not waited for; the wait itself is bounded (504).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from sparkrl.proto import (
    CommandResponse,
    CommandResult,
    ControlBody,
    ControlCommand,
    ControlState,
    encode_message,
)
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.control_channel import CONTROL_LOG, CONTROL_STATE_KEY, read_control_state
from sparkrl.services.common.hparams import Problem, check, split
from sparkrl.services.common.telemetry import LEARNER, Telemetry, worker_target

RESULTS_LOG = "commands"
_WAIT_SLICE_MS = 500  # each wait for results; between slices, targets that vanished are let go

# Who obeys what: the learner all of it, the workers what concerns sampling and their own lifecycle.
_LEARNER_COMMANDS = {"pause", "resume", "stop", "checkpoint", "set_hparams"}
_WORKER_COMMANDS = {"pause", "resume", "stop", "set_hparams"}


class NoTarget(RuntimeError):
    """Nobody live could apply the command (409): the message names who is missing."""


class Rejected(ValueError):
    """Values out of bounds, or not parameters of the running loss (422)."""

    problems: list[Problem]

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(f"{p.name}: {p.msg}" for p in problems))
        self.problems = problems


@dataclass
class TimedOut(RuntimeError):
    """Some targets did not answer within the timeout (504)."""

    command_id: str
    waiting_for: list[str]
    results: list[CommandResult]
    timeout_s: float

    def __str__(self) -> str:
        return (
            f"no answer from {', '.join(self.waiting_for)} within {self.timeout_s:g}s "
            "(control.command_timeout_s); the learner answers at its next step boundary, workers between "
            "batches. The command stays issued: watch /api/v1/events for its results"
        )


class Commander:
    """The control service's only writer to the control stream."""

    def __init__(self, bus: RedisBus, telemetry: Telemetry, timeout_s: float) -> None:
        self.bus, self.telemetry, self.timeout_s = bus, telemetry, timeout_s

    def targets(self, body: ControlBody) -> list[str]:
        """The live targets that must answer `body`; raises NoTarget when a needed one is missing."""
        learner = self.telemetry.learner()
        learner_live = Telemetry.learner_alive(learner)
        workers = [worker_target(w) for w in self.telemetry.live_workers()]
        name = body.command
        if name == "set_hparams":
            mine, theirs = split(body.values)  # type: ignore[union-attr]
            if mine and not learner_live:
                raise NoTarget(f"no live learner to apply {', '.join(mine)}: is it running?")
            if theirs and not workers:
                raise NoTarget(f"no live rollout worker to apply {', '.join(theirs)}")
            return ([LEARNER] if mine else []) + (workers if theirs else [])
        if name == "checkpoint" and not learner_live:
            raise NoTarget("no live learner to write a checkpoint: is it running?")
        targets = ([LEARNER] if learner_live and name in _LEARNER_COMMANDS else []) + (
            workers if name in _WORKER_COMMANDS else []
        )
        if not targets:
            raise NoTarget(f"nothing is running to {name}: no live learner and no live rollout worker")
        return targets

    def validate(self, values: dict[str, float | int]) -> None:
        """Bounds from the settings models; loss parameters must belong to the learner's loss."""
        learner = self.telemetry.learner()
        loss = learner.hyperparameters.get("loss") if learner is not None else None
        problems = check(values, str(loss) if loss is not None else None)
        if problems:
            raise Rejected(problems)

    def issue(self, body: ControlBody) -> CommandResponse:
        """Send `body` to every live target that obeys it and wait for their answers."""
        if body.command == "set_hparams":
            self.validate(body.values)  # type: ignore[union-attr]
        targets = self.targets(body)
        command = ControlCommand(command_id=uuid.uuid4().hex, issued_at=time.time(), body=body)
        cursor = self.bus.logs.last_id(RESULTS_LOG)  # before sending: no answer can slip past
        self._record_state(body)
        self.bus.logs.append(CONTROL_LOG, encode_message(command))
        return self._await(command, targets, cursor)

    def _record_state(self, body: ControlBody) -> None:
        """What a (re)starting service adopts: paused or not, and the live sampling values."""
        if body.command not in ("pause", "resume", "set_hparams"):
            return
        state = read_control_state(self.bus)
        if body.command == "set_hparams":
            _, sampling = split(body.values)  # type: ignore[union-attr]
            if not sampling:
                return
            update = {"sampling": state.sampling | {k: float(v) for k, v in sampling.items()}}
        else:
            update = {"paused": body.command == "pause"}
        new = ControlState.model_validate(state.model_dump() | update | {"updated_at": time.time()})
        self.bus.set_value(CONTROL_STATE_KEY, encode_message(new))

    def _await(self, command: ControlCommand, targets: list[str], cursor: str) -> CommandResponse:
        waiting, gone = set(targets), []
        results: dict[str, CommandResult] = {}
        deadline = time.monotonic() + self.timeout_s
        cursors = {RESULTS_LOG: cursor}
        while waiting:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise TimedOut(command.command_id, sorted(waiting), list(results.values()), self.timeout_s)
            for event in self.telemetry.follow(cursors, block_ms=min(_WAIT_SLICE_MS, remaining_ms)):
                result = event.message
                if isinstance(result, CommandResult) and result.command_id == command.command_id:
                    results[result.target] = result
                    waiting.discard(result.target)
            live = {worker_target(w) for w in self.telemetry.workers()}
            for target in sorted(t for t in waiting if t != LEARNER and t not in live):
                waiting.discard(target)  # its heartbeat expired: it will not answer
                gone.append(target)
        outcomes = {r.outcome for r in results.values()}
        outcome = outcomes.pop() if len(outcomes) == 1 else ("partial" if outcomes else "rejected")
        return CommandResponse(
            command_id=command.command_id,
            command=command.body.command,
            outcome=outcome,
            results=[results[t] for t in targets if t in results],
            gone=gone,
        )
