"""The live progress line of `sparkrl up` (from the telemetry channel's newest step row) and the final
summary (from `RUN_DIR/metrics.jsonl`, once the run is over)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from sparkrl.proto import StepMetrics
from sparkrl.run_files import (
    SUMMARY_FILE,
    Wall,
    count_by_stream,
    fmt,
    last_present,
    load_dead_letters,
    read_ended,
    read_session,
    read_steps,
    reward_halves,
    wall_text,
    wall_time,
    worker_key,
)


def _versions_text(versions: dict[str, int | None]) -> str:
    # `worker-3` → `w3`: the line must fit a terminal with a dozen workers.
    short = {w: re.sub(r"^worker-(\d+)$", r"w\1", w) for w in versions}
    return " ".join(f"{short[w]}:{versions[w]}" for w in sorted(versions, key=worker_key))


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


OpState = Literal["missing", "building", "built"]  # DeepSpeed's op in the extensions folder


def startup_line(
    elapsed_s: float,
    learner_state: str | None,
    op: OpState,
    workers: dict[str, str],
    deadline_s: float | None = None,
) -> str:
    """Before the first step: what each part of the stack is doing, so a first run's long start (DeepSpeed
    compiling its op) is not silence. `op`: the op not built yet, being built (torch's build lock is held)
    or built; `workers`: id → state from their heartbeats."""
    if learner_state in (None, "starting"):
        learner = {
            "missing": "compiling DeepSpeed's op (first run, ~30-60 s)",
            "building": "compiling DeepSpeed's op (~30-60 s, once)",
            "built": "loading the model and DeepSpeed's engine",
        }[op]
    else:
        learner = f"{learner_state}, waiting for the first groups"
    parts = [f"starting {elapsed_s:.0f}s" + (f" (gives up at {deadline_s:.0f}s)" if deadline_s else "")]
    parts.append(f"learner: {learner}")
    parts += [f"{w}: {state}" for w, state in sorted(workers.items(), key=lambda item: worker_key(item[0]))]
    if not workers:
        parts.append("workers: loading the model")
    return " | ".join(parts)


def startup_facts(
    first_step_s: float, learner: dict[str, float] | None, workers: dict[str, dict[str, float]]
) -> dict[str, Any]:
    """The start-up's story at the first step: seconds from the stack's start to it, and each service's
    phases (start_clock.py; from the heartbeats: `learner`, worker id → its phases)."""
    return {"to_first_step_s": round(first_step_s, 1), "learner": learner or {}, "workers": workers}


def startup_text(facts: dict[str, Any]) -> str:
    """One line: `started in 8.7 s | learner: imports 3.2 s, model 0.3 s, … | w0: …`."""

    def phases(named: dict[str, float]) -> str:
        return ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in named.items()) or "not reported"

    parts = [f"started in {facts['to_first_step_s']:.1f} s"]
    parts.append(f"learner: {phases(facts['learner'])}")
    parts += [
        f"{worker}: {phases(facts['workers'][worker])}" for worker in sorted(facts["workers"], key=worker_key)
    ]
    return " | ".join(parts)


def _dead_text(counts: dict[str, int] | None, run_dir: Path) -> str:
    if counts is None:
        return "unknown (no dead_letters.jsonl)"
    said = f"{counts['prompts']} prompts (by the workers), {counts['groups']} groups (by the learner)"
    return said + (f": `sparkrl dead --run-dir {run_dir}` lists them" if any(counts.values()) else "")


def summarize(run_dir: Path | str) -> str:
    """A few lines on the run from its files; the same facts go to `RUN_DIR/summary.json`."""
    run_dir = Path(run_dir)
    summary, wall = _facts(run_dir)
    try:
        (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        written = str(run_dir / SUMMARY_FILE)
    except OSError as exc:  # a full disk: the lines below still say how the run ended
        written = f"not written ({exc})"
    said = f" in {wall_text(wall)}" if summary["steps"] else ""
    this_start = summary["steps_this_start"]
    if summary["steps"] and this_start is not None and this_start < summary["steps"]:  # a resumed run
        said = f" ({this_start} in this start){said}"
    versions = _versions_text(summary["worker_versions"]) or "none reported"
    stale = summary["groups_dropped_stale"]
    return "\n".join(
        [
            f"run {run_dir}: {summary['steps']} steps{said}",
            f"  reward mean: {fmt(summary['reward_mean_first_20pct'], '.3f')} (first 20% of steps)"
            f" → {fmt(summary['reward_mean_last_20pct'], '.3f')} (last 20%)",
            f"  final entropy: {fmt(summary['final_entropy'], '.3f')}",
            f"  groups gone stale: {stale}"
            + (
                " (older than learner.max_staleness: their prompts were fed again and made anew)"
                if stale
                else ""
            ),
            f"  dead-lettered: {_dead_text(summary['dead_lettered'], run_dir)}",
            f"  ended: {summary['ended'] or 'unknown (the learner wrote no ended.json)'}",
            f"  versions: learner {summary['policy_version']} | workers {versions}",
            f"  checkpoints: {summary['checkpoints_dir']}/ ({', '.join(summary['checkpoints']) or 'none'})",
            f"  summary: {written}",
        ]
    )


def _facts(run_dir: Path) -> tuple[dict[str, Any], Wall]:
    """What summary.json holds: the step rows' story (the report tells the same one), the checkpoints,
    what was set aside and why the run ended."""
    steps = read_steps(run_dir)
    rows = steps.rows
    _, early, late = reward_halves(steps)
    wall = wall_time(run_dir, [row.time for row in rows])
    dead = load_dead_letters(run_dir)
    checkpoints = run_dir / "checkpoints"
    return {
        "run_dir": str(run_dir),
        "steps": rows[-1].step if rows else 0,
        # Of the last start (after --resume, this one's): launch → its first step row → its last.
        "wall_seconds": round(wall.total_s, 1) if rows else None,
        "startup_seconds": None if wall.startup_s is None or not rows else round(wall.startup_s, 1),
        "paused_seconds": round(wall.paused_s, 1),
        "steps_this_start": wall.steps if wall.startup_s is not None else None,
        "reward_mean_first_20pct": early,
        "reward_mean_last_20pct": late,
        "final_entropy": last_present(steps.series("loss/entropy")),
        "policy_version": rows[-1].policy_version if rows else None,
        # The last row that has them: after Ctrl-C the workers stop first, and the last row often has none.
        "worker_versions": next((r.worker_versions for r in reversed(rows) if r.worker_versions), {}),
        "checkpoints_dir": str(checkpoints),
        "checkpoints": sorted(p.name for p in checkpoints.iterdir()) if checkpoints.is_dir() else [],
        "groups_dropped_stale": int(rows[-1].value("rollout/dropped_stale_total") or 0) if rows else 0,
        "dead_lettered": None if dead is None else count_by_stream(dead),  # None: the run left no record
        "ended": read_ended(run_dir).get("reason"),
        "startup": read_session(run_dir) or None,
    }, wall
