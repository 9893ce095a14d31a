"""The learner's journal: what each step since the last checkpoint trained on, on the learner's own disk.

Why: a step's groups are acknowledged (and marked trained) right after the step, but its update lives
only in memory until the next checkpoint. A crash in between would lose those updates while the bus
says the groups were used. So before acknowledging, the learner writes the step's raw entries (the
encoded groups, as they came off the stream) to `RUN_DIR/journal/step-NNNNNN.bin`, fsynced; a
checkpoint at step C deletes the files up to C; a resume from C replays the files after C, in order,
as the same steps. Nothing is acknowledged that is neither in a checkpoint nor in the journal.

The journal's size is one step's group bytes times `learner.checkpoint_every`.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import msgpack

from sparkrl.services.common.bus import Entry

log = logging.getLogger("sparkrl.learner.journal")

_NAME = re.compile(r"^step-(\d{6,})\.bin$")


class Journal:
    """`RUN_DIR/journal/`: one file per step since the newest checkpoint."""

    directory: Path

    def __init__(self, run_dir: Path) -> None:
        self.directory = run_dir / "journal"
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:06d}.bin"

    def write(self, step: int, entries: list[Entry]) -> None:
        """Record a step's entries durably (temp file, fsync, rename, fsync of the folder)."""
        records = [
            {"entry_id": e.entry_id, "item_id": e.item_id, "payload": e.payload, "deliveries": e.deliveries}
            for e in entries
        ]
        data = msgpack.packb({"step": step, "entries": records}, use_bin_type=True)
        tmp = self.directory / f".step-{step:06d}.{os.getpid()}.tmp"
        with tmp.open("wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, self.path(step))
        _fsync_dir(self.directory)

    def steps(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := _NAME.match(p.name)))

    def read(self, step: int) -> list[Entry]:
        record = msgpack.unpackb(self.path(step).read_bytes(), raw=False)
        if record.get("step") != step:
            raise ValueError(f"{self.path(step)} holds step {record.get('step')}, not {step}")
        return [Entry(r["entry_id"], r["item_id"], r["payload"], r["deliveries"]) for r in record["entries"]]

    def replayable(self, after: int) -> list[int]:
        """Steps after `after` that follow it without a gap (a gap ends the replay, loudly)."""
        steps, expected = [], after + 1
        for step in (s for s in self.steps() if s > after):
            if step != expected:
                log.error(
                    "journal gap: step %d follows %d; replaying up to %d only",
                    step,
                    expected - 1,
                    expected - 1,
                )
                break
            steps.append(step)
            expected += 1
        return steps

    def trim(self, upto: int | None = None) -> int:
        """Delete the files of steps ≤ `upto` (None: all); returns how many."""
        removed = 0
        for step in self.steps():
            if upto is None or step <= upto:
                self.path(step).unlink(missing_ok=True)
                removed += 1
        return removed


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the folder's entry is on disk too.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
