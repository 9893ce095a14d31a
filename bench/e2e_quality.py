"""Time to quality for `bench/e2e_bench.py`: each system's saved models scored on the same held-out problems
(`sparkrl.evaluate`, 8 samples at T = 1), each dated by its files, and the wall time at which held-out
pass@1 first reaches a target.

    python bench/e2e_quality.py score DIR [DIR ...]   # one JSON line: {dir: pass@1}, one process for all

sparkrl's checkpoints (`RUN/checkpoints/step-N/hf`, `learner.checkpoint_every`) and TRL's
(`WORKDIR/checkpoint-N`, bench/trl_checkpoints.py) are scored alike, after the runs (evaluating while
training would take the CPU from the run being timed). A model's time is its newest file's modification
time less the run's start: when it was written, checkpointing included.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve()
PROBLEMS, SAMPLES = 512, 8


@dataclass(frozen=True)
class Point:
    """One saved model: its step, seconds since its run started, held-out pass@1 (None until scored)."""

    step: int
    seconds: float
    path: Path
    pass_at_1: float | None = None


def written_at(folder: Path) -> float:
    """When the newest file under `folder` was written (unix time)."""
    return max(p.stat().st_mtime for p in folder.rglob("*") if p.is_file())


def sparkrl_points(run_dir: Path, started: float) -> list[Point]:
    """The run's kept checkpoints (`step-N`), oldest first."""
    found = [
        Point(int(m.group(1)), written_at(p) - started, p)
        for p in (run_dir / "checkpoints").glob("step-*")
        if (m := re.fullmatch(r"step-0*(\d+)", p.name)) and (p / "hf").is_dir()
    ]
    return sorted(found, key=lambda point: point.step)


def trl_points(workdir: Path, started: float) -> list[Point]:
    """TRL's saved models (`checkpoint-N`), oldest first."""
    found = [
        Point(int(p.name.split("-")[1]), written_at(p) - started, p)
        for p in workdir.glob("checkpoint-*")
        if (p / "config.json").is_file()
    ]
    return sorted(found, key=lambda point: point.step)


def scored(points: list[Point]) -> list[Point]:
    """`points` with their held-out pass@1: one evaluation process for all (the model loads dominate less)."""
    if not points:
        return []
    command = [sys.executable, str(HERE), "score", *(str(p.path) for p in points)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    by_path = json.loads(done.stdout.strip().splitlines()[-1])
    return [Point(p.step, p.seconds, p.path, by_path[str(p.path)]) for p in points]


def first_reaching(points: list[Point], target: float) -> float | None:
    """Seconds at which pass@1 first reaches `target`; None if it never does."""
    return next((p.seconds for p in points if p.pass_at_1 is not None and p.pass_at_1 >= target), None)


def curve(points: list[Point]) -> list[list[float | None]]:
    """[[step, seconds, pass@1], ...] for the JSON line."""
    return [[p.step, round(p.seconds, 1), p.pass_at_1] for p in points]


def _score(paths: list[str]) -> None:
    from sparkrl.evaluate import evaluate

    print(json.dumps({path: evaluate(Path(path), problems=PROBLEMS, n=SAMPLES).pass_at[1] for path in paths}))


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "score":
        raise SystemExit(__doc__)
    _score(sys.argv[2:])
