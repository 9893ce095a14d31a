"""The files a run directory holds, read in one place, and the few ways their values are printed.

Writers: the learner (`metrics.jsonl`, a `StepMetrics` a line; `weights.jsonl`, a `SyncEvent` a line;
`ended.json`), the evaluator (`eval.jsonl`, an `EvalRecord` a line), `sparkrl up` (`dead_letters.jsonl`,
`summary.json`). Readers, all through this module: `sparkrl report`, the summary `sparkrl up` prints,
`sparkrl dead`, the launcher (ended.json), the benchmarks.

A line that does not parse is skipped and counted, never fatal: the learner may be mid-write (a cut last
line), and one bad line must not hide the rest of a long run. A value that is missing prints as `MISSING`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from sparkrl.proto.base import WireModel
from sparkrl.proto.run_files import DeadLetterRecord
from sparkrl.proto.telemetry import EvalRecord, StepMetrics, SyncEvent

METRICS_FILE = "metrics.jsonl"
WEIGHTS_FILE = "weights.jsonl"
EVAL_FILE = "eval.jsonl"
ENDED_FILE = "ended.json"
SUMMARY_FILE = "summary.json"
DEAD_LETTERS_FILE = "dead_letters.jsonl"
MISSING = "—"  # a value the run did not record, wherever a tool prints one

_Model = TypeVar("_Model", bound=WireModel)


# ── reading ───────────────────────────────────────────────────────────────────────────────────────────


def tail_bytes(path: Path, max_bytes: int) -> bytes:
    """The last `max_bytes` of a file (empty when it does not exist yet)."""
    try:
        with path.open("rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - max_bytes))
            return file.read()
    except FileNotFoundError:
        return b""


def read_jsonl(path: Path, model: type[_Model]) -> tuple[list[_Model], int]:
    """The valid records of a jsonl file, in file order, and how many lines were skipped (none and 0 when
    the file does not exist)."""
    records: list[_Model] = []
    skipped = 0
    for line in tail_bytes(path, 1 << 62).decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            records.append(model.model_validate_json(line))
        except ValidationError:
            skipped += 1
    return records, skipped


@dataclass(frozen=True)
class Steps:
    """`metrics.jsonl`: one row per step, the last written for it (after a resume the redone steps are the
    ones that count), in step order."""

    rows: list[StepMetrics]
    superseded: int  # rows replaced by a later row for the same step
    skipped: int  # unreadable lines

    def series(self, name: str) -> list[float | None]:
        """`name` at every step, None where the step lacks it."""
        return [row.value(name) for row in self.rows]


def read_steps(run_dir: Path) -> Steps:
    written, skipped = read_jsonl(run_dir / METRICS_FILE, StepMetrics)
    by_step = {row.step: row for row in written}
    rows = [by_step[step] for step in sorted(by_step)]
    return Steps(rows, len(written) - len(rows), skipped)


def read_evals(run_dir: Path) -> list[EvalRecord]:
    """`eval.jsonl`: one record per evaluated version (the last written), in version order."""
    evals = read_jsonl(run_dir / EVAL_FILE, EvalRecord)[0]
    return sorted({e.policy_version: e for e in evals}.values(), key=lambda e: e.policy_version)


def read_sync_events(run_dir: Path) -> list[SyncEvent] | None:
    """`weights.jsonl`, the broadcasts in the order the learner made them; None when there is no file."""
    path = run_dir / WEIGHTS_FILE
    return read_jsonl(path, SyncEvent)[0] if path.is_file() else None


def read_ended(run_dir: Path) -> dict[str, Any]:
    """`ended.json`: why the run ended (`reason`, and the prompts' counts where the data ran out); empty
    when the run wrote none, or not readably."""
    with contextlib.suppress(OSError, ValueError):
        ended = json.loads((run_dir / ENDED_FILE).read_text())
        if isinstance(ended, dict):
            return ended
    return {}


def load_dead_letters(run_dir: Path) -> list[DeadLetterRecord] | None:
    """`dead_letters.jsonl`, oldest first; None when the run left no file."""
    path = run_dir / DEAD_LETTERS_FILE
    return read_jsonl(path, DeadLetterRecord)[0] if path.is_file() else None


def count_by_stream(records: list[DeadLetterRecord]) -> dict[str, int]:
    """Distinct prompts (set aside by the workers) and groups (by the learner) among `records`."""
    ids: dict[str, set[str]] = {"prompts": set(), "trajectories": set()}
    for record in records:
        ids[record.stream].add(record.item_id)
    return {"prompts": len(ids["prompts"]), "groups": len(ids["trajectories"])}


STARTUP_FILE = "startup.json"  # the last start of the run, as `sparkrl up` tells it (sparkrl/session.py)


def read_session(run_dir: Path) -> dict[str, Any]:
    """`startup.json`: `launched_at`, the start-up's story, `paused` intervals; empty when there is none."""
    with contextlib.suppress(OSError, ValueError):
        facts = json.loads((run_dir / STARTUP_FILE).read_text())
        if isinstance(facts, dict):
            return facts
    return {}


def paused_within(paused: list[list[float | None]], start: float, end: float) -> float:
    """Seconds of the paused intervals between `start` and `end` (one still open runs to `end`)."""
    total = 0.0
    for began, ended in paused:
        if began is not None:
            total += max(0.0, min(end, ended if ended is not None else end) - max(start, began))
    return total


@dataclass(frozen=True)
class Wall:
    """The wall time of the run's last start: launch → its last step row."""

    total_s: float
    startup_s: float | None  # launch → its first step row; None: the launch is not known
    paused_s: float  # the learner paused (control commands) between its first and last step row
    steps: int  # step rows this start wrote


def wall_time(run_dir: Path, times: list[float]) -> Wall:
    """From the step rows' times (in step order). The launch is `startup.json`'s `launched_at` (sparkrl
    up writes it as it starts: after `--resume` only this start's rows count); a run without it, from the
    learner's config (written just before the first spawn). Without either, from the first row. The
    summary and the report both say this one figure."""
    session = read_session(run_dir)
    launched = session.get("launched_at")
    if not isinstance(launched, (int, float)):
        with contextlib.suppress(FileNotFoundError):
            launched = (run_dir / "config" / "learner.yaml").stat().st_mtime
    own = [t for t in times if isinstance(launched, (int, float)) and t >= launched]
    if not own:  # no launch known, or this start trained nothing: the rows' span, start-up unknown
        return Wall(max(0.0, times[-1] - times[0]) if times else 0.0, None, 0.0, 0)
    paused = paused_within(session.get("paused") or [], own[0], own[-1])
    return Wall(own[-1] - launched, own[0] - launched, paused, len(own))


# ── values ────────────────────────────────────────────────────────────────────────────────────────────


def mean(values: list[float | None]) -> float | None:
    """The mean of the present values; None when none is."""
    present = [value for value in values if value is not None]
    return sum(present) / len(present) if present else None


def last_present(values: list[float | None]) -> float | None:
    return next((value for value in reversed(values) if value is not None), None)


def reward_halves(steps: Steps) -> tuple[int, float | None, float | None]:
    """(count, early, late): the mean reward over the first and the last 20% of steps (rounded up, at least
    one each): did training help? The summary and the report both say these."""
    count = max(1, math.ceil(0.2 * len(steps.rows)))
    values = steps.series("rollout/reward_mean")
    return count, mean(values[:count]), mean(values[-count:])


# ── printing ──────────────────────────────────────────────────────────────────────────────────────────


def fmt(value: float | None, spec: str = ".4g") -> str:
    return MISSING if value is None else format(value, spec)


def worker_key(name: str) -> tuple[str, int]:
    """`worker-10` after `worker-9`, not between `worker-1` and `worker-2`."""
    match = re.fullmatch(r"(.*?)(\d+)", name)
    return (match.group(1), int(match.group(2))) if match else (name, -1)


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def wall_text(wall: Wall) -> str:
    """`3m 33s (start-up 13.4 s, training 3m 19s)`, `… paused 40.0 s)` when the learner was paused."""
    if wall.startup_s is None:
        return duration(wall.total_s)
    training = wall.total_s - wall.startup_s - wall.paused_s
    paused = f", paused {duration(wall.paused_s)}" if wall.paused_s > 0.05 else ""
    parts = f"start-up {duration(wall.startup_s)}, training {duration(training)}{paused}"
    return f"{duration(wall.total_s)} ({parts})"
