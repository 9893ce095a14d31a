"""The live progress line of `sparkrl up` (from the telemetry channel's newest step row) and the final
summary (from `RUN_DIR/metrics.jsonl`, once the run is over)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from sparkrl.dead_letters import count_by_stream, load_dead_letters
from sparkrl.proto import StepMetrics


def tail_bytes(path: Path, max_bytes: int) -> bytes:
    """The last `max_bytes` of a file (empty when it does not exist yet)."""
    try:
        with path.open("rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - max_bytes))
            return file.read()
    except FileNotFoundError:
        return b""


def _read_records(path: Path, max_bytes: int = 1 << 40) -> list[dict[str, Any]]:
    records = []
    for raw in tail_bytes(path, max_bytes).splitlines():
        # A line cut by the tail window, or still being written by the learner, is skipped.
        with contextlib.suppress(ValueError):
            record = json.loads(raw)
            if isinstance(record, dict):
                records.append(record)
    return records


def _worker_key(name: str) -> tuple[str, int]:
    match = re.fullmatch(r"(.*?)(\d+)", name)
    return (match.group(1), int(match.group(2))) if match else (name, -1)


def _versions_text(versions: dict[str, Any]) -> str:
    # `worker-3` → `w3`: the line must fit a terminal with a dozen workers.
    short = {w: re.sub(r"^worker-(\d+)$", r"w\1", w) for w in versions}
    return " ".join(f"{short[w]}:{versions[w]}" for w in sorted(versions, key=_worker_key))


def _metric(record: dict[str, Any], name: str) -> float | None:
    """`metrics[name]` of a `StepMetrics` row as read back from JSON; None when absent or not a number."""
    metrics = record.get("metrics")
    value = metrics.get(name) if isinstance(metrics, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def progress_line(row: StepMetrics | None, max_steps: int | None = None) -> str | None:
    """`step 12/40 | reward 0.31 | entropy 1.23 | loss -0.004 | versions w0:11 w1:12 | sync 0.21s`.

    From the newest step row (None before the first step: no line). `max_steps` is where the run ends (the
    learner's status: learner.max_steps, or sooner where the data runs out); without it the step has no
    total. Metrics the row lacks are left out.
    """
    if row is None:
        return None
    parts = [f"step {row.step}" + (f"/{max(max_steps, row.step)}" if max_steps else "")]
    for name, label, spec in (
        ("rollout/reward_mean", "reward", ".2f"),
        ("loss/entropy", "entropy", ".2f"),
        ("loss/value", "loss", ".3g"),
    ):
        value = row.value(name)
        if value is not None:
            parts.append(f"{label} {value:{spec}}")
    if row.worker_versions:
        parts.append(f"versions {_versions_text(row.worker_versions)}")
    sync = row.value("sync/seconds")
    if sync is not None:
        parts.append(f"sync {sync:.2f}s")
    stale = row.value("rollout/dropped_stale_total")
    if stale:
        parts.append(f"stale made again {stale:.0f}")
    return " | ".join(parts)


def startup_line(
    elapsed_s: float,
    learner_state: str | None,
    op_built: bool,
    workers: dict[str, str],
    deadline_s: float | None = None,
) -> str:
    """Before the first step: what each part of the stack is doing, so a first run's long start (DeepSpeed
    compiling its op) is not silence. `workers`: id → state from their heartbeats."""
    if learner_state in (None, "starting"):
        learner = (
            "building DeepSpeed's engine" if op_built else "compiling DeepSpeed's op (first run, ~30-60 s)"
        )
    else:
        learner = f"{learner_state}, waiting for the first groups"
    parts = [f"starting {elapsed_s:.0f}s" + (f" (gives up at {deadline_s:.0f}s)" if deadline_s else "")]
    parts.append(f"learner: {learner}")
    parts += [f"{w}: {state}" for w, state in sorted(workers.items(), key=lambda item: _worker_key(item[0]))]
    if not workers:
        parts.append("workers: loading the model")
    return " | ".join(parts)


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def wall_time(run_dir: Path, first_step_at: float, last_step_at: float) -> tuple[float, float | None]:
    """(wall seconds, start-up seconds): from the launch — the learner's config is written just before
    the first spawn — to the last step row, and from the launch to the first. Without the config, from
    the first step (start-up unknown). The summary and the report both say this one figure."""
    try:
        launched = (run_dir / "config" / "learner.yaml").stat().st_mtime
    except FileNotFoundError:
        return max(0.0, last_step_at - first_step_at), None
    if launched > first_step_at:  # a resume rewrote the config: this session's start is unknown
        return max(0.0, last_step_at - first_step_at), None
    return last_step_at - launched, first_step_at - launched


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def wall_text(total_s: float, startup_s: float | None) -> str:
    """`3m 33s (start-up 13.4 s, training 3m 19s)`."""
    if startup_s is None:
        return duration(total_s)
    return f"{duration(total_s)} (start-up {duration(startup_s)}, training {duration(total_s - startup_s)})"


def _ended(run_dir: Path) -> str | None:
    """Why the learner ended (its ended.json), when it said."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return str(json.loads((run_dir / "ended.json").read_text())["reason"])
    return None


def _dead_lettered(run_dir: Path) -> dict[str, int] | None:
    """Prompts and groups set aside, from what the run left (None: it left no record)."""
    records = load_dead_letters(run_dir)
    return count_by_stream(records) if records is not None else None


def _dead_text(counts: dict[str, int] | None, run_dir: Path) -> str:
    if counts is None:
        return "unknown (no dead_letters.jsonl)"
    said = f"{counts['prompts']} prompts (by the workers), {counts['groups']} groups (by the learner)"
    return said + (f": `sparkrl dead --run-dir {run_dir}` lists them" if any(counts.values()) else "")


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else f"{value:{spec}}"


def summarize(run_dir: Path | str) -> str:
    """A few lines on the run from `metrics.jsonl`; the same facts go to `RUN_DIR/summary.json`."""
    run_dir = Path(run_dir)
    records = _read_records(run_dir / "metrics.jsonl")
    last = records[-1] if records else {}
    fifth = max(1, math.ceil(0.2 * len(records)))
    checkpoints = run_dir / "checkpoints"
    summary = {
        "run_dir": str(run_dir),
        "steps": last.get("step", len(records)),
        "wall_seconds": None,
        "startup_seconds": None,
        "reward_mean_first_20pct": _mean([_metric(r, "rollout/reward_mean") for r in records[:fifth]]),
        "reward_mean_last_20pct": _mean([_metric(r, "rollout/reward_mean") for r in records[-fifth:]]),
        "final_entropy": _metric(last, "loss/entropy"),
        "policy_version": last.get("policy_version"),
        "worker_versions": last.get("worker_versions") or {},
        "checkpoints_dir": str(checkpoints),
        "checkpoints": sorted(p.name for p in checkpoints.iterdir()) if checkpoints.is_dir() else [],
        "groups_dropped_stale": int(_metric(last, "rollout/dropped_stale_total") or 0),
        "dead_lettered": _dead_lettered(run_dir),
        "ended": _ended(run_dir),
    }
    wall = ""
    if records and "time" in records[0] and "time" in last:
        total, startup = wall_time(run_dir, float(records[0]["time"]), float(last["time"]))
        summary["wall_seconds"], summary["startup_seconds"] = round(total, 1), startup and round(startup, 1)
        wall = f" in {wall_text(total, startup)}"
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    versions = _versions_text(summary["worker_versions"]) or "none reported"
    return "\n".join(
        [
            f"run {run_dir}: {summary['steps']} steps{wall}",
            f"  reward mean: {_fmt(summary['reward_mean_first_20pct'])} (first 20% of steps)"
            f" → {_fmt(summary['reward_mean_last_20pct'])} (last 20%)",
            f"  final entropy: {_fmt(summary['final_entropy'])}",
            f"  groups gone stale: {summary['groups_dropped_stale']}"
            + (
                " (older than learner.max_staleness: their prompts were fed again and made anew)"
                if summary["groups_dropped_stale"]
                else ""
            ),
            f"  dead-lettered: {_dead_text(summary['dead_lettered'], run_dir)}",
            f"  ended: {summary['ended'] or 'unknown (the learner wrote no ended.json)'}",
            f"  versions: learner {summary['policy_version']} | workers {versions}",
            f"  checkpoints: {checkpoints}/ ({', '.join(summary['checkpoints']) or 'none'})",
            f"  summary: {run_dir / 'summary.json'}",
        ]
    )


# ── sparkrl up ────────────────────────────────────────────────────────────────────────────────────────
