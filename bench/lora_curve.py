"""The demo's reward curve with LoRA (r = 16) beside full fine-tuning, in one invocation: `make demo`'s
run (`--preset demo`, 200 steps of Lp-Reg on the tiny countdown model) three times — every weight trained
(the baseline), LoRA r = 16 / alpha 32 on every linear layer at the demo's learning rate, and the same at
ten times it (LoRA is usually given a larger one) — each version sent as the adapter alone. Prints per
run the reward of the first and last fifth of the steps, seconds a step, bytes per version, and the
held-out pass@1 of the checkpoints (`bench/e2e_quality.py`'s scoring: 512 problems, 8 samples), with
ratios against the baseline; writes the curves to docs/lora-curve.png and one JSON line.

    .venv/bin/python bench/lora_curve.py [--steps 200] [--workdir runs/lora-curve]

The wide learning-quality experiment, when it runs, is paused meanwhile (bench/hold_experiment.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from sparkrl.proto import SyncEvent
from sparkrl.run_files import read_steps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from e2e_quality import scored, sparkrl_points  # noqa: E402
from recipe_knobs import hold, up  # noqa: E402

LORA = ("learner.lora.r=16", "learner.lora.alpha=32")
RUNS: dict[str, tuple[str, ...]] = {
    "full": (),
    "lora_r16": LORA,
    "lora_r16_lr10x": (*LORA, "learner.lr=3e-3"),
}


def summary(run_dir: Path, started: float) -> dict[str, Any]:
    rows = read_steps(run_dir).rows
    rewards = [r.metrics["rollout/reward_mean"] for r in rows]
    fifth = max(1, len(rewards) // 5)
    events = [SyncEvent.model_validate_json(line) for line in (run_dir / "weights.jsonl").open()]
    ok = [e for e in events if e.outcome == "ok"]
    points = scored(sparkrl_points(run_dir, started))
    return {
        "steps": len(rows),
        "s_per_step": (rows[-1].time - rows[0].time) / max(len(rows) - 1, 1),
        "reward_first20": statistics.mean(rewards[:fifth]),
        "reward_last20": statistics.mean(rewards[-fifth:]),
        "bytes_per_version": statistics.median(e.bytes for e in ok) if ok else None,
        "sync_s": statistics.median(e.seconds for e in ok if e.seconds is not None) if ok else None,
        "held_out": {p.step: p.pass_at_1 for p in points},
        "rewards": rewards,
    }


def plot(results: dict[str, dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, result in results.items():
        rewards = result["rewards"]
        window = 10
        smooth = [statistics.mean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
        ax.plot(range(1, len(smooth) + 1), smooth, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("reward (mean of 10 steps)")
    ax.set_title("demo preset: full fine-tuning against LoRA r=16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "lora-curve")
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    hold("stop")
    try:
        for name, overrides in RUNS.items():
            run_dir = args.workdir / name
            print(f"{name}: sparkrl up --preset demo {' '.join(overrides)}", flush=True)
            sets = (*overrides, f"learner.max_steps={args.steps}", "learner.checkpoint_every=50")
            if (run_dir / "metrics.jsonl").is_file():  # a run of an earlier invocation: run afresh
                shutil.rmtree(run_dir)
            started = up("demo", run_dir, sets)
            result = results[name] = summary(run_dir, started)
            print(
                f"  {name}: reward {result['reward_first20']:.3f} → {result['reward_last20']:.3f}", flush=True
            )
    finally:
        hold("cont")
    base = results["full"]
    last = max(base["held_out"]) if base["held_out"] else None
    print(f"\n{'run':<16}{'reward first':>13}{'last':>8}{'x full':>8}{'s/step':>8}{'x full':>8}"
          f"{'MB/version':>12}{'x full':>8}{'held-out':>10}")  # fmt: skip
    for name, r in results.items():
        held = r["held_out"].get(last) if last is not None else None
        mb = (r["bytes_per_version"] or 0) / 1e6
        print(
            f"{name:<16}{r['reward_first20']:>13.3f}{r['reward_last20']:>8.3f}"
            f"{r['reward_last20'] / base['reward_last20']:>8.2f}{r['s_per_step']:>8.2f}"
            f"{r['s_per_step'] / base['s_per_step']:>8.2f}{mb:>12.3f}"
            f"{(r['bytes_per_version'] or 0) / (base['bytes_per_version'] or 1):>8.3f}"
            f"{held if held is not None else float('nan'):>10.3f}"
        )
    plot(results, ROOT / "docs" / "lora-curve.png")
    print(json.dumps({name: {k: v for k, v in r.items() if k != "rewards"} for name, r in results.items()}))


if __name__ == "__main__":
    main()
