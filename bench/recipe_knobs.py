"""The recipe knobs measured (issue 33), in one invocation, one run after another:

1. **Dynamic sampling on the demo**: `sparkrl up --preset demo` with `learner.filter_groups` none and
   zero_variance (200 steps, a model kept every 40). Per run: groups trained per second and groups made
   per second (steady: from the 10th-percentile step row to the last), seconds per step, the filtered
   share; then, after every timed run of both parts, every kept model scored on the same 512 held-out
   problems (8 samples at T = 1, bench/e2e_quality.py: no evaluation takes the CPU from a timed run) and
   held-out pass@1 at fixed wall times since launch (the newest model written by then): half the
   baseline's last model's time, and that time.
2. **Mismatch corrections on the vLLM preset** (`configs/vllm-cpu.yaml`: workers on vLLM's CPU build, the
   learner recomputing π_old): token TIS (the preset: `tis_cap` 2) against masked IS (IcePop:
   `learner.is_mask` token, [0.5, 5], no cap), the same in a narrow band [0.9, 1.1], and token TIS with
   `learner.fp32_lm_head`. Per run, means over its steps: the rollout/learner mismatch KL
   (`loss/mismatch_kl`, k1, and `mismatch_k3`), the policy ratio KL (`loss/ratio_kl`: 0 by construction
   with the preset's one update per step, π_old recomputed at the weights it updates), the capped and
   masked shares of tokens and sequences, the reward's first and last fifth, seconds per step. Needs
   `make vllm-env` (`--vllm-python`); `--skip-vllm` leaves it out and says so.

    .venv/bin/python bench/recipe_knobs.py --hold-experiment   # both parts, one JSON line last
    .venv/bin/python bench/recipe_knobs.py --skip-vllm         # the demo part alone

`--demo-rounds R` runs the demo pair R times, the order swapped every round (a run right after another is
not timed alike on a shared machine); the figures are each round's and their mean, the ratios
(zero_variance / none, each vLLM variant / token TIS) from the means. `--score points` scores only the
models the wall times pick (and each run's last), not every kept one: the evaluation is most of the
invocation's time on a loaded machine.

`--hold-experiment` pauses the long experiment (bench/hold_experiment.py) for the timed runs only (20
minutes here with `--demo-rounds 2`, other work on the machine) and lets it go on while the models are
scored; it is let go on however the timed part ends (an error, Ctrl-C, SIGTERM). If this process is
killed outright, run `.venv/bin/python bench/hold_experiment.py cont`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sparkrl.run_files import read_steps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from e2e_quality import Point, curve, scored, sparkrl_points  # noqa: E402

SAVE_EVERY = 40
LOADS: list[float] = []  # the 1-minute load average at each run's launch
DEMO_RUNS = {"none": (), "zero_variance": ("learner.filter_groups=zero_variance",)}
VLLM_RUNS = {
    "token_tis": (),
    "masked_is": ("learner.tis_cap=null", "learner.is_mask=token"),
    # IcePop's band masks nothing where vLLM and the learner agree this closely: a narrow one shows it act.
    "masked_is_narrow": (
        "learner.tis_cap=null",
        "learner.is_mask=token",
        "learner.is_mask_low=0.9",
        "learner.is_mask_high=1.1",
    ),
    "token_tis_fp32_head": ("learner.fp32_lm_head=true",),
}
MISMATCH = ("mismatch_kl", "mismatch_k3", "ratio_kl", "tis_weight_mean", "is_capped_share", "is_masked_share")


def up(preset: str, run_dir: Path, overrides: tuple[str, ...]) -> float:
    """`sparkrl up` to the end; its launch time (unix)."""
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--preset", preset, "--run-dir", str(run_dir)]
    for override in overrides:
        command += ["--set", override]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKRL_")}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    started = time.time()
    LOADS.append(os.getloadavg()[0])  # the machine is shared: what else ran is part of the figures
    process = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _, stderr = process.communicate()
    except BaseException:  # Ctrl-C, SIGTERM: stop the stack as its own Ctrl-C does, not leave its services
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        raise
    if process.returncode != 0:
        raise SystemExit(f"{preset} {' '.join(overrides)}: exited {process.returncode}\n{stderr[-3000:]}")
    return started


def steady(run_dir: Path, started: float) -> dict[str, Any]:
    """Throughput and the filter's account from the step rows (steady: after the first tenth of steps)."""
    rows = read_steps(run_dir).rows
    skip = max(1, len(rows) // 10)
    window = rows[skip:]
    seconds = window[-1].time - rows[skip - 1].time
    trained = sum(r.metrics["rollout/groups"] or 0 for r in window)
    uninformative = sum(r.metrics.get("rollout/groups_uninformative") or 0 for r in window)
    filtered = sum(r.metrics.get("rollout/groups_filtered") or 0 for r in window)
    rewards = [r.metrics["rollout/reward_mean"] for r in rows]
    fifth = max(1, len(rewards) // 5)
    return {
        "steps": len(rows),
        "wall_s": rows[-1].time - started,
        "startup_s": rows[0].time - started,
        "s_per_step": seconds / len(window),
        "groups_trained_per_s": trained / seconds,
        "informative_groups_trained_per_s": (trained - uninformative) / seconds,
        "groups_made_per_s": (trained + filtered) / seconds,
        "filtered_share": filtered / max(trained + filtered, 1),
        "reward_first20": statistics.mean(rewards[:fifth]),
        "reward_last20": statistics.mean(rewards[-fifth:]),
    }


def pass_at(points: list[Point], seconds: float) -> float | None:
    """Held-out pass@1 of the newest model written within `seconds` of launch (None: none yet)."""
    written = [p for p in points if p.seconds <= seconds]
    return written[-1].pass_at_1 if written else None


Rounds = list[dict[str, dict[str, Any]]]  # per round, per knob: the run's figures
RoundPoints = list[dict[str, list[Point]]]  # per round, per knob: its kept models


def demo_runs(workdir: Path, steps: int, rounds: int) -> tuple[Rounds, RoundPoints]:
    """The timed demo runs, `rounds` pairs (the order swapped every round): their figures, and their kept
    models (dated, not yet scored)."""
    saving = (f"learner.checkpoint_every={SAVE_EVERY}", "learner.keep_checkpoints=100")
    results: Rounds = []
    points: RoundPoints = []
    for r in range(rounds):
        results.append({})
        points.append({})
        order = list(DEMO_RUNS) if r % 2 == 0 else list(reversed(DEMO_RUNS))
        for name in order:
            run_dir = workdir / f"demo-{name}-r{r + 1}"
            started = up("demo", run_dir, (f"learner.max_steps={steps}", *saving, *DEMO_RUNS[name]))
            results[r][name] = steady(run_dir, started) | {"order": order.index(name) + 1}
            points[r][name] = sparkrl_points(run_dir, started)
            print(f"demo round {r + 1}, filter_groups {name}: {json.dumps(results[r][name])}", flush=True)
    return results, points


def wall_points(points: dict[str, list[Point]]) -> tuple[float, float]:
    """The fixed wall times of one round: half the baseline's last model's time, and that time (one both
    runs reached)."""
    end = points["none"][-1].seconds
    return end / 2, end


def to_score(points: dict[str, list[Point]], everything: bool) -> dict[str, list[Point]]:
    """The models to score: all kept ones, or those the wall times pick and each run's last."""
    if everything:
        return points
    times = wall_points(points)
    picked: dict[str, list[Point]] = {}
    for name, kept in points.items():
        chosen = {id(p) for t in times for p in [q for q in kept if q.seconds <= t][-1:]} | {id(kept[-1])}
        picked[name] = [p for p in kept if id(p) in chosen]
    return picked


def held_out(results: Rounds, points: RoundPoints, everything: bool) -> dict[str, Any]:
    """The models scored (one evaluation process for all), each run's held-out pass@1 at its round's two
    wall times, and the rounds' means."""
    points = [to_score(round_points, everything) for round_points in points]
    flat = [p for round_points in points for name in DEMO_RUNS for p in round_points[name]]
    every = scored(flat)
    for r, round_points in enumerate(points):
        for name in DEMO_RUNS:
            n = len(round_points[name])
            round_points[name], every = every[:n], every[n:]
            results[r][name]["curve"] = curve(round_points[name])
        half, end = wall_points(round_points)
        for name in DEMO_RUNS:
            results[r][name]["pass1_at_half"] = pass_at(round_points[name], half)
            results[r][name]["pass1_at_end"] = pass_at(round_points[name], end)
        results[r]["wall_points_s"] = [round(half, 1), round(end, 1)]  # type: ignore[assignment]
    mean = {name: mean_of([results[r][name] for r in range(len(results))]) for name in DEMO_RUNS}
    return {
        "rounds": results,
        "mean": mean,
        "ratio_zero_variance_vs_none": ratios(mean["zero_variance"], mean["none"]),
    }


def mean_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of each number the runs all have (None where one lacks it)."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        values = [run.get(key) for run in runs]
        if isinstance(value, (int, float)) and all(isinstance(v, (int, float)) for v in values):
            out[key] = statistics.mean(values)
    return out


RATIO_KEYS = (
    "groups_trained_per_s",
    "informative_groups_trained_per_s",
    "groups_made_per_s",
    "s_per_step",
    "pass1_at_half",
    "pass1_at_end",
    "mismatch_kl",
    "mismatch_k3",
    "ratio_kl",
)


def ratios(variant: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    """variant / baseline for the figures both have (None where the baseline's is 0 or missing)."""
    out: dict[str, float | None] = {}
    for key in RATIO_KEYS:
        a, b = variant.get(key), baseline.get(key)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            out[key] = round(a / b, 3) if b else None
    return out


def vllm_part(workdir: Path, steps: int, vllm_python: str) -> dict[str, Any]:
    """Each variant's run; one that fails is recorded as failed (the others, and the demo's, stand)."""
    results: dict[str, Any] = {}
    for name, knob in VLLM_RUNS.items():
        run_dir = workdir / f"vllm-{name}"
        try:
            started = up(
                "vllm-cpu", run_dir, (f"learner.max_steps={steps}", f"rollout.python={vllm_python}", *knob)
            )
        except SystemExit as failed:
            results[name] = {"error": str(failed)[-1500:]}
            print(f"vllm-cpu, {name}: FAILED {failed}", flush=True)
            continue
        result = steady(run_dir, started)
        rows = read_steps(run_dir).rows
        for key in (*MISMATCH, "is_capped_seq_share", "is_masked_seq_share"):
            values = [r.metrics.get(f"loss/{key}") for r in rows]
            values = [v for v in values if v is not None]
            result[key] = statistics.mean(values) if values else None
        results[name] = result
        print(f"vllm-cpu, {name}: {json.dumps(result)}", flush=True)
    baseline = results.get("token_tis", {})
    results["ratio_vs_token_tis"] = {
        name: ratios(result, baseline)
        for name, result in results.items()
        if name != "token_tis" and "error" not in result
    }
    return results


def hold(action: str) -> None:
    """Pause (`stop`) or continue (`cont`) the long experiment, if one runs."""
    subprocess.run([sys.executable, str(ROOT / "bench" / "hold_experiment.py"), action], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo-steps", type=int, default=200)
    parser.add_argument("--demo-rounds", type=int, default=1, help="demo pairs, the order swapped each round")
    parser.add_argument(
        "--score", choices=("all", "points"), default="all", help="which kept models to score"
    )
    parser.add_argument("--vllm-steps", type=int, default=60)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--hold-experiment", action="store_true", help="pause it for the timed runs")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="recipe-knobs-"))
    began = time.time()
    line: dict[str, Any] = {}
    if args.hold_experiment:
        # SIGTERM (a timeout, `kill`) ends this process through the `finally` below, which lets it go on.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        hold("stop")
    try:
        demo, points = demo_runs(workdir, args.demo_steps, args.demo_rounds)
        if args.skip_vllm:
            line["vllm"] = "not run: --skip-vllm"
        elif not Path(args.vllm_python).is_file():
            line["vllm"] = f"not run: no {args.vllm_python} (make vllm-env)"
        else:
            line["vllm"] = vllm_part(workdir, args.vllm_steps, args.vllm_python)
    finally:
        if args.hold_experiment:
            hold("cont")
    line["timed_minutes"] = round((time.time() - began) / 60, 1)
    line["demo"] = held_out(demo, points, args.score == "all")
    line["minutes"] = round((time.time() - began) / 60, 1)
    line["load_at_launches"] = [round(load, 1) for load in LOADS]
    line["workdir"] = str(workdir)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
