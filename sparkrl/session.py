"""This start of a run as `sparkrl up` tells it: when it was launched, which telemetry records are its own
(after `--resume` the run's Redis still holds the start before's status, step rows and heartbeats), what
control commands did to it (pause, resume, set, checkpoint, stop: said on the console as they happen), and
`RUN_DIR/startup.json`, from which the summary tells start-up, training and paused time apart.

`startup.json`: `launched_at` (Unix time, written at launch), the start-up's story once the first step is
in (`to_first_step_s`, `learner`, `workers`: run_report.startup_facts), and `paused`: [from, to] Unix times
the learner was paused (`to` None: still paused when the run ended).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

from sparkrl.proto import CommandResult, LearnerStatus, StepMetrics, WorkerStatus
from sparkrl.run_files import STARTUP_FILE
from sparkrl.services.common.bus.logs import START
from sparkrl.services.common.telemetry import LOGS, Telemetry

_COMMANDS = LOGS["command"][0]


class Session:
    """One `sparkrl up` of a run directory, from its launch."""

    run_dir: Path
    launched_at: float  # Unix time; records older than this are the start before's
    facts: dict[str, Any]  # what startup.json holds
    cursor: str  # the command log, read up to here

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.launched_at = time.time()
        self.facts = {"launched_at": self.launched_at, "paused": []}
        self.cursor = START
        self._write()  # replaces the start before's: its phases must not be read as this one's

    def learner(self, status: LearnerStatus | None) -> LearnerStatus | None:
        """The learner's status if this start's learner wrote it."""
        return status if status is not None and status.heartbeat_at >= self.launched_at else None

    def step(self, row: StepMetrics | None) -> StepMetrics | None:
        """The newest step row if this start trained it."""
        return row if row is not None and row.time >= self.launched_at else None

    def workers(self, workers: dict[str, WorkerStatus]) -> dict[str, WorkerStatus]:
        return {w: s for w, s in workers.items() if s.heartbeat_at >= self.launched_at}

    def started(self, facts: dict[str, Any]) -> None:
        """The start-up's story at the first step (run_report.startup_facts)."""
        self.facts.update(facts)
        self._write()

    def commands(self, telemetry: Telemetry) -> list[str]:
        """What control commands did since the last call, one line each; pauses are kept for the summary."""
        said = []
        cursors = {_COMMANDS: self.cursor}
        events = telemetry.follow(cursors, None)  # advances the cursor in place
        self.cursor = cursors[_COMMANDS]
        for event in events:
            result = event.message
            if not isinstance(result, CommandResult) or result.at < self.launched_at:
                continue  # the start before's (a resumed run's Redis keeps them)
            text = self._command_text(result)
            if text is not None:
                said.append(text)
        return said

    def _command_text(self, result: CommandResult) -> str | None:
        """The line for one outcome; None for a worker's applied pause, resume, stop (the learner's says
        it for the run, and a fleet of workers would repeat it)."""
        who = "learner" if result.target == "learner" else result.target.removeprefix("worker:")
        if who != "learner" and result.outcome == "applied" and result.command != "set_hparams":
            return None
        at = f" at step {result.step}" if result.step is not None else ""
        if result.outcome == "rejected":
            return f"control: {result.command} rejected by the {who}{at}: {result.detail}"
        if result.target == "learner" and result.command == "pause":
            self._pause(result.at)
            return f"control: paused{at} (`sparkrl resume --run-dir {self.run_dir}` goes on)"
        if result.target == "learner" and result.command == "resume":
            paused = self._unpause(result.at)
            return f"control: resumed{at}" + (f" after {paused:.1f} s paused" if paused is not None else "")
        if result.command == "set_hparams":
            values = ", ".join(f"{name}={_value(value)}" for name, value in sorted(result.values.items()))
            return f"control: {who} set {values or result.detail}{at}"
        detail = f": {result.detail}" if result.detail else ""
        return f"control: {result.command} applied by the {who}{at}{detail}"

    def _pause(self, at: float) -> None:
        paused = self.facts["paused"]
        if not paused or paused[-1][1] is not None:
            paused.append([at, None])
            self._write()

    def _unpause(self, at: float) -> float | None:
        paused = self.facts["paused"]
        if not paused or paused[-1][1] is not None:
            return None
        paused[-1][1] = at
        self._write()
        return at - paused[-1][0]

    def _write(self) -> None:
        with contextlib.suppress(OSError):
            (self.run_dir / STARTUP_FILE).write_text(json.dumps(self.facts, indent=2))


def _value(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
