"""The dead letters a run leaves behind: `RUN_DIR/dead_letters.jsonl`, one `DeadLetterRecord` a line, oldest
first. `sparkrl up` writes it as it stops, while the run's Redis still runs (a private Redis goes with the
run); `sparkrl dead --run-dir` lists it once the run is over, and the summary counts it (both read it
through `run_files`).
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from sparkrl.proto.run_files import DeadLetterRecord
from sparkrl.run_files import DEAD_LETTERS_FILE
from sparkrl.services.common.bus import DeadLetter, RedisBus


def as_record(bus: RedisBus, letter: DeadLetter) -> DeadLetterRecord:
    """A dead letter of `bus` without its payload (a group's is megabytes of tensors)."""
    stream = "prompts" if letter.stream == bus.stream_key("prompts") else "trajectories"
    return DeadLetterRecord(
        record_id=letter.record_id,
        stream=stream,
        item_id=letter.item_id,
        reason=letter.reason,
        time_ms=letter.time_ms,
        deliveries=letter.deliveries,
    )


def save_dead_letters(bus: RedisBus, run_dir: Path) -> int:
    """Write every dead letter the stream holds to RUN_DIR/dead_letters.jsonl (replaced whole, so a reader
    never sees half a file); how many."""
    letters = bus.dead_letters(count=max(1, bus.dead_letter_count()))  # newest first
    lines = [as_record(bus, letter).model_dump_json() + "\n" for letter in reversed(letters)]
    path = run_dir / DEAD_LETTERS_FILE
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(lines))
    os.replace(partial, path)
    return len(lines)


def listing(record: DeadLetterRecord) -> str:
    """Two lines of `sparkrl dead`: id, time, stream, item, deliveries; then the reason."""
    when = datetime.datetime.fromtimestamp(record.time_ms / 1000).isoformat(timespec="seconds")
    return (
        f"{record.record_id}  {when}  {record.stream:<12} {record.item_id}  deliveries {record.deliveries}"
        f"\n    {record.reason}"
    )
