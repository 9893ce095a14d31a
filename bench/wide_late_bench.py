"""A late step of the wide experiment, this checkout against a git revision, in one invocation.

    .venv/bin/python bench/wide_late_bench.py --baseline REV \
        --model runs/learning-quality-wide/grpo-s1/checkpoints/latest/hf

Late in a wide run (`configs/explore-wide.yaml`, dynamic sampling) the model answers most prompts all
right or all wrong, so ~95-98% of the groups sampled are set aside and a step waits on the fleet:
generation, scoring, publishing and the learner's intake of every group sampled. This starts the preset
from a late checkpoint's weights (`--model`: a run's `checkpoints/step-N/hf`), `--steps` steps, no
evaluator, from each side's tree in turn (the baseline's from `git archive`; the same model, prompts and
settings), and reads its step rows: the median time between steps after the first, and the groups the
fleet sampled a second (trained + set aside, over the same steps). Prints each run, the medians per side
and the ratios. Nothing else may run meanwhile: pause an experiment (`bench/hold_experiment.py stop`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from reward_bench import _baseline_tree

from sparkrl.run_files import read_steps

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 1800


@dataclass
class Late:
    step_s: float  # median time between step rows, the first step left out
    groups_per_s: float  # groups sampled (trained + set aside) a second over those steps
    set_aside: float  # share of them set aside


def _run(tree: Path | None, model: Path, steps: int, run_dir: Path) -> Late:
    command = [
        sys.executable, "-m", "sparkrl.cli", "up", "--preset", "explore-wide", "--run-dir", str(run_dir),
        "--overwrite", "--set", f"model={model}", "--set", f"learner.max_steps={steps}",
        "--set", f"learner.checkpoint_every={steps + 1}",
    ]  # fmt: skip
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    log = run_dir.with_suffix(".log")
    with log.open("w") as out:
        done = subprocess.run(command, cwd=tree or ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=RUN_TIMEOUT_S)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the run failed (exit {done.returncode}); {log} ends:\n{log.read_text()[-3000:]}")
    rows = read_steps(run_dir).rows[1:]  # the first step includes start-up and the first fill
    if len(rows) < 2:
        raise SystemExit(f"{run_dir}: fewer than 3 step rows; raise --steps")
    gaps = np.diff([row.time for row in rows])
    trained = sum(row.value("rollout/groups") or 0.0 for row in rows[1:])
    aside = sum(row.value("rollout/groups_filtered") or 0.0 for row in rows[1:])
    sampled = trained + aside
    return Late(float(np.median(gaps)), sampled / float(gaps.sum()), aside / max(sampled, 1.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a late checkpoint's hf/ folder")
    parser.add_argument("--baseline", default="HEAD", help="the git revision to compare with (default HEAD)")
    parser.add_argument("--steps", type=int, default=5, help="steps per run (the first is left out)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per side, alternating")
    args = parser.parse_args()
    model = args.model.resolve()
    if not (model / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there; give a checkpoint's hf/ folder")
    results: dict[str, list[Late]] = {"baseline": [], "this checkout": []}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="wide-late-") as tmp:
        baseline = _baseline_tree(args.baseline, Path(tmp) / "tree")
        print(f"{args.steps} steps of explore-wide from {model}; baseline {args.baseline}", flush=True)
        for round_ in range(args.rounds):
            for name, tree in (("baseline", baseline), ("this checkout", None)):
                run_dir = Path(tmp) / f"{'base' if tree else 'this'}-{round_}"
                late = _run(tree, model, args.steps, run_dir)
                results[name].append(late)
                said = f"{late.step_s:5.1f} s a step, {late.groups_per_s:5.1f} groups sampled a second"
                print(f"  round {round_ + 1} {name:>13}: {said}, {late.set_aside:.0%} set aside", flush=True)
    fields = ("step_s", "groups_per_s", "set_aside")
    median = {
        name: Late(*(statistics.median(getattr(r, f) for r in runs) for f in fields))
        for name, runs in results.items()
    }
    for name, late in median.items():
        print(f"median {name:>13}: {late.step_s:5.1f} s a step, {late.groups_per_s:5.1f} groups a second")
    base, this = median["baseline"], median["this checkout"]
    minutes = (time.monotonic() - started) / 60
    print(f"ratio (this / baseline): step time ×{this.step_s / base.step_s:.2f}, groups sampled a second "
          f"×{this.groups_per_s / base.groups_per_s:.2f} ({minutes:.1f} min)")  # fmt: skip


if __name__ == "__main__":
    main()
