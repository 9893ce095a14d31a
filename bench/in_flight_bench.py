"""Weight updates between batches against in flight (`rollout.weight_updates`), in one invocation.

usage: python bench/in_flight_bench.py [--only long|tail|demo ...] [--engine torch|vllm]
                                       [--long-steps 10] [--tail-steps 20] [--demo-steps 200] [--hold]

Each workload runs `sparkrl up` (the demo preset: one worker, 16 prompts x 8 samples a step,
max_staleness 2) once per variant — between_batches, in_flight with the cache kept, in_flight with it
recomputed — in an order rotated per workload:

- `long`: the 3.3M-parameter model of bench/long_model.py, completions of exactly 128 tokens (EOS
  suppressed; vLLM refuses min_new_tokens: there up to 128), where a batch takes seconds.
- `tail`: the same model with a long tail of completion lengths: stop strings "0".."7" end a sample when
  the (untrained, near-uniform) model emits one of those 8 of its 260 tokens, so lengths are about
  geometric (median ~15, mean ~24 tokens) and ~2% of samples run to the 128-token cap; a batch lasts as
  long as its longest sample.
- `demo`: the demo as it is (the trained tiny model, <= 24 tokens), the one whose held-out pass@1 moves.

Per run, from its step rows: steady steps per second (median step interval after the first tenth), the
mean and max version lag per token (`rollout/token_lag_mean`, `_max`: versions between a token's sampler
and the version trained against), the share of tokens at lag 0, the share of samples with two versions,
the learner's wait for data and for the fleet per step (`time/wait_data_s`, `time/wait_fleet_s`), and the
held-out pass@1 of the final model (`sparkrl eval`: 256 problems x 8 samples for the demo; 64 x 4 at 32
tokens for the long model, which learns nothing in a few steps). Then the ratios in_flight /
between_batches; the last line is JSON. `--hold` pauses the wide learning-quality experiment
(bench/hold_experiment.py) during each workload, only when it is running (one someone else paused stays
theirs), and always continues it afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from sparkrl.run_files import read_steps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from long_model import ensure_long_model  # noqa: E402

HOLD = ROOT / "bench" / "hold_experiment.py"
EXPERIMENT = "learning_quality.py --wide"
TAIL_STOPS = [str(d) for d in range(8)]


@dataclass(frozen=True)
class Workload:
    name: str
    model: Path
    steps: int
    overrides: tuple[str, ...]
    problems: int  # held-out evaluation
    samples: int
    eval_tokens: int


@dataclass(frozen=True)
class Variant:
    label: str
    key: str
    overrides: tuple[str, ...]


IN_FLIGHT = "rollout.weight_updates=in_flight"
VARIANTS = (
    Variant("between_batches", "between", ("rollout.weight_updates=between_batches",)),
    Variant("in_flight keep", "keep", (IN_FLIGHT, "rollout.in_flight.kv_cache=keep")),
    Variant("in_flight recompute", "recompute", (IN_FLIGHT, "rollout.in_flight.kv_cache=recompute")),
)


def workloads(args: argparse.Namespace) -> list[Workload]:
    cache = ROOT / ".cache"
    long_model = ensure_long_model(cache)
    fixed = ["rollout.sampling.max_new_tokens=128"]
    # vLLM refuses min_new_tokens (its log-probs would carry the EOS mask): there the untrained model's
    # own EOS (~1 in 260 tokens) ends about 40% of the samples before 128.
    fixed += ["rollout.sampling.min_new_tokens=128"] if args.engine == "torch" else []
    tail = ["rollout.sampling.max_new_tokens=128", f"rollout.sampling.stop={json.dumps(TAIL_STOPS)}"]
    found = [
        Workload("long", long_model, args.long_steps, tuple(fixed), 64, 4, 32),
        Workload("tail", long_model, args.tail_steps, tuple(tail), 64, 4, 32),
        Workload("demo", cache / "tiny-countdown", args.demo_steps, (), 256, 8, 24),
    ]
    return [w for w in found if not args.only or w.name in args.only]


def engine_overrides(engine: str) -> list[str]:
    if engine == "torch":
        return []
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no vLLM environment at {python}: `make vllm-env` creates it")
    return ["rollout.engine.kind=vllm", f"rollout.python={python}", "rollout.engine.threads=1"]


def run(work: Workload, variant: Variant, engine: str, workdir: Path) -> dict[str, Any]:
    """One `sparkrl up` of `work` with `variant`; its numbers."""
    run_dir = workdir / f"{work.name}-{variant.key}"
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--preset", "demo", "--run-dir", str(run_dir)]
    sets = [f"model={work.model}", f"learner.max_steps={work.steps}", "learner.checkpoint_every=100000"]
    for override in [*sets, *work.overrides, *variant.overrides, *engine_overrides(engine)]:
        command += ["--set", override]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKRL_")}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    started = time.time()
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{work.name}/{variant.label} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return summarize(run_dir, time.time() - started) | heldout(run_dir, work)


def summarize(run_dir: Path, wall: float) -> dict[str, Any]:
    rows = read_steps(run_dir).rows
    times = [r.time for r in rows]
    skip = max(1, len(rows) // 10)
    intervals = [b - a for a, b in zip(times[skip:], times[skip + 1 :], strict=False)]
    steady = rows[skip:] or rows

    def mean(name: str) -> float:
        values = [v for r in steady if (v := r.metrics.get(name)) is not None]
        return statistics.mean(values) if values else 0.0

    return {
        "wall_s": wall,
        "steps_per_s": 1 / statistics.median(intervals) if intervals else None,
        "lag_mean": mean("rollout/token_lag_mean"),
        "lag_max": max((r.metrics.get("rollout/token_lag_max") or 0) for r in rows),
        "lag0_share": mean("rollout/token_lag_0_share"),
        "mixed_share": mean("rollout/mixed_version_share"),
        "wait_data_s": mean("time/wait_data_s"),
        "wait_fleet_s": mean("time/wait_fleet_s"),
        "tokens_per_step": mean("rollout/tokens"),
    }


def heldout(run_dir: Path, work: Workload) -> dict[str, float]:
    """`sparkrl eval` of the run's final model (its last checkpoint)."""
    command = [sys.executable, "-m", "sparkrl.cli", "eval", str(run_dir), "--problems", str(work.problems)]
    command += ["--n", str(work.samples), "--max-new-tokens", str(work.eval_tokens), "--threads", "2"]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    return {"pass@1": json.loads(done.stdout.strip().splitlines()[-1])["pass@1"]}


@contextmanager
def quiet(enabled: bool) -> Iterator[bool]:
    """The wide experiment paused while the block runs, when it is running; yields whether it was held."""
    running = enabled and any(
        EXPERIMENT in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_STOPPED
        for p in psutil.process_iter(["cmdline", "status"])
    )
    if running:
        subprocess.run([sys.executable, str(HOLD), "stop"], check=True, capture_output=True)
    try:
        yield running
    finally:
        if running:
            subprocess.run([sys.executable, str(HOLD), "cont"], check=True, capture_output=True)


def line(label: str, r: dict[str, Any]) -> str:
    rate = f"{r['steps_per_s']:.3f}" if r["steps_per_s"] else "  n/a"
    return (
        f"  {label:20s} {rate} steps/s | lag/token mean {r['lag_mean']:.2f} max {r['lag_max']:.0f} | "
        f"lag 0 {100 * r['lag0_share']:3.0f}% | two versions {100 * r['mixed_share']:3.0f}% | wait data "
        f"{r['wait_data_s']:.2f} s, fleet {r['wait_fleet_s']:.2f} s | pass@1 {r['pass@1']:.3f} | "
        f"wall {r['wall_s']:.0f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=["long", "tail", "demo"])
    parser.add_argument("--engine", choices=["torch", "vllm"], default="torch")
    parser.add_argument("--long-steps", type=int, default=10)
    parser.add_argument("--tail-steps", type=int, default=20)
    parser.add_argument("--demo-steps", type=int, default=200)
    parser.add_argument("--hold", action="store_true", help="pause the wide experiment per workload")
    args = parser.parse_args()
    summary: dict[str, Any] = {"engine": args.engine, "load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="sparkrl-inflight-") as tmp:
        for turn, work in enumerate(workloads(args)):
            order = VARIANTS[turn % len(VARIANTS) :] + VARIANTS[: turn % len(VARIANTS)]
            with quiet(args.hold) as held:
                print(f"{work.name} ({args.engine}, {work.steps} steps{', experiment held' if held else ''}, "
                      f"load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
                runs = {v.key: run(work, v, args.engine, Path(tmp)) for v in order}
            for variant in VARIANTS:
                print(line(variant.label, runs[variant.key]), flush=True)
            base = runs["between"]
            for key in ("keep", "recompute"):
                if base["steps_per_s"] and runs[key]["steps_per_s"]:
                    ratio = runs[key]["steps_per_s"] / base["steps_per_s"]
                    print(f"  in_flight {key} / between_batches: {ratio:.2f}x steps/s, lag/token "
                          f"{runs[key]['lag_mean']:.2f} vs {base['lag_mean']:.2f}", flush=True)  # fmt: skip
            summary[work.name] = {k: {n: round(v, 4) if isinstance(v, float) else v for n, v in r.items()}
                                  for k, r in runs.items()}  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
