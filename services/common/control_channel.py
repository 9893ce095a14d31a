"""The control stream, as the services that obey it see it: new commands in order, each answered once.

The control service appends every `ControlCommand` to the capped log `control` (no consumer group: the
learner and every worker each read all of it) and keeps the fleet's desired `ControlState` (paused,
live sampling values) in a Redis value. A service starting up adopts that state, then follows the log
from its newest record; so a late joiner or a restarted learner is paused when the fleet is, without
replaying old commands. Each target answers every command that concerns it with a `CommandResult` on
the telemetry channel, which the POST that issued the command is waiting for.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from sparkrl.proto import ControlCommand, ControlState, HparamValue
from sparkrl.proto.codec import decode_message
from sparkrl.proto.errors import CodecError
from sparkrl.proto.telemetry import CommandResult
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.telemetry import Telemetry

log = logging.getLogger("sparkrl.control")

CONTROL_LOG = "control"
CONTROL_STATE_KEY = "control_state"  # bus value: the ControlState JSON


def read_control_state(bus: RedisBus) -> ControlState:
    """The fleet's desired state; the default (running, as configured) when none was ever set."""
    raw = bus.get_value(CONTROL_STATE_KEY)
    if raw is not None:
        try:
            return decode_message(raw, ControlState)
        except CodecError as exc:
            log.warning("ignoring a malformed control state: %s", exc)
    return ControlState(updated_at=0.0)


class ControlReader:
    """One target's (`learner`, `worker:<id>`) reader of the control stream. One thread uses it."""

    bus: RedisBus
    telemetry: Telemetry
    target: str
    cursor: str
    _buffer: deque[ControlCommand]

    def __init__(self, bus: RedisBus, telemetry: Telemetry, target: str) -> None:
        self.bus, self.telemetry, self.target = bus, telemetry, target
        # Cursor before state: a command issued in between is seen both ways, and every command is
        # idempotent (pause twice is paused), so nothing falls in the gap.
        self.cursor = bus.logs.last_id(CONTROL_LOG)
        self._buffer = deque()

    def initial_state(self) -> ControlState:
        return read_control_state(self.bus)

    def pending(self) -> bool:
        """Whether a command is waiting (it is kept for `poll`); one Redis round trip, no wait."""
        self._fill()
        return bool(self._buffer)

    def poll(self) -> list[ControlCommand]:
        """Every command issued since the last poll, oldest first; malformed records are skipped."""
        self._fill()
        commands = list(self._buffer)
        self._buffer.clear()
        return commands

    def answer(
        self,
        command: ControlCommand,
        outcome: str,
        detail: str,
        step: int | None = None,
        values: dict[str, HparamValue] | None = None,
    ) -> CommandResult:
        """Report the outcome where the issuer waits for it (and the page shows it)."""
        result = CommandResult(
            command_id=command.command_id,
            command=command.body.command,
            target=self.target,
            outcome=outcome,
            detail=detail[:2000],
            step=step,
            values=values or {},
            at=time.time(),
        )
        self.telemetry.append(result)
        log.info(
            "%s %s (%s): %s — %s", self.target, command.body.command, command.command_id, outcome, detail
        )
        return result

    def _fill(self) -> None:
        for record in self.bus.logs.follow({CONTROL_LOG: self.cursor}, block_ms=None):
            self.cursor = record.record_id
            try:
                self._buffer.append(decode_message(record.payload, ControlCommand))
            except CodecError as exc:
                # No command id to answer to: the issuer (which validated it) times out and says so.
                log.error("ignoring malformed control record %s: %s", record.record_id, exc)
