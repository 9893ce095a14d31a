"""Issuing control commands: decide who must answer, record the fleet's desired state, append the command
to the control stream, and wait for every target's `CommandResult`.

Nothing is sent when a target is missing (409) or a value is out of bounds (422); a target that stops
(a learner that stopped or went silent, a worker whose heartbeat expired) while we wait is reported as
`gone`, not waited for — and when every target went that way, nobody applied it (409); the wait itself is
bounded (504); when the service itself shuts down, a command waiting is answered at once (503).
"""

from __future__ import annotations

import threading
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
from sparkrl.services.common.settings.hparams import Problem, check, split
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


@dataclass
class ShuttingDown(RuntimeError):
    """The control service is stopping (503): nothing was sent, or (`command_id`) the command was sent and
    these targets had not answered yet."""

    command_id: str | None = None
    waiting_for: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.command_id is None:
            return "the control service is shutting down: nothing was sent; try again once it is back"
        return (
            f"the control service is shutting down: command {self.command_id} was sent and "
            f"{', '.join(self.waiting_for)} had not answered yet (it may still apply it; "
            "/api/v1/events shows its results once the service is back)"
        )


class Commander:
    """The control service's only writer to the control stream. `stopping`: set when the service shuts
    down; every command then answers at once instead of being cut off mid-wait."""

    def __init__(self, bus: RedisBus, telemetry: Telemetry, timeout_s: float) -> None:
        self.bus, self.telemetry, self.timeout_s = bus, telemetry, timeout_s
        self.stopping = threading.Event()

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
        if self.stopping.is_set():
            raise ShuttingDown()
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
            if self.stopping.is_set():
                raise ShuttingDown(command.command_id, tuple(sorted(waiting)))
            if remaining_ms <= 0:
                raise TimedOut(command.command_id, sorted(waiting), list(results.values()), self.timeout_s)
            for event in self.telemetry.follow(cursors, block_ms=min(_WAIT_SLICE_MS, remaining_ms)):
                result = event.message
                if isinstance(result, CommandResult) and result.command_id == command.command_id:
                    results[result.target] = result
                    waiting.discard(result.target)
            live = {worker_target(w) for w in self.telemetry.workers()}
            if waiting and Telemetry.learner_alive(self.telemetry.learner()):
                live.add(LEARNER)
            for target in sorted(t for t in waiting if t not in live):
                waiting.discard(target)  # stopped, or its heartbeat expired: it will not answer
                gone.append(target)
        if gone and not results:
            raise NoTarget(
                f"{', '.join(gone)} stopped before answering command {command.command_id}: it was most "
                "likely not applied (a run that is stopping takes no more commands)"
            )
        outcomes = {r.outcome for r in results.values()}
        outcome = outcomes.pop() if len(outcomes) == 1 else ("partial" if outcomes else "rejected")
        return CommandResponse(
            command_id=command.command_id,
            command=command.body.command,
            outcome=outcome,
            results=[results[t] for t in targets if t in results],
            gone=gone,
        )
