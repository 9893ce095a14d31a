"""The wide experiment's step, before and after (issue 29): the same 4-step probe of
`configs/explore-wide.yaml` under each variant, in one invocation.

    .venv/bin/python bench/wide_step.py [--steps 4] [--rounds 1]

Each variant is a real `sparkrl up --preset explore-wide` (private Redis, the reward service, one worker,
the DeepSpeed learner) of `--steps` steps into a temporary run directory; the rounds interleave the
variants so a noisy spell of the machine hits them alike. Printed per variant: the median over the steps
after the first (the first pays the warm-up) of `time/forward_backward_s`, `time/entropy_of_skipped_s`
and `time/step_seconds`, the padding and the share of tokens skipped; then the ratios against the first
variant (> 1: faster) and one JSON line. The variants:

- `preset`: the preset as committed until issue 29 (every row run, padded; entropy over every token);
- `packed`: A = 0 answers skipped, the micro-batch packed into rows of 128, and the skipped answers'
  entropy measured apart (`learner.entropy_of_skipped`), so `loss/entropy` is still over every token:
  the same gradient and the same entropy (tests/test_work_skipping.py);
- `shared`: as `packed`, each group's answers behind one copy of their prompt (`learner.share_prompts`):
  the same gradient and entropy again (tests/test_prompt_sharing.py).

Run it on a quiet machine: pause any long experiment first (SIGSTOP its process group, SIGCONT after).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from sparkrl.run_files import read_steps  # noqa: E402

VARIANTS: dict[str, tuple[str, ...]] = {  # learner.* overrides
    "preset": ("skip_zero_advantage=false", "pack_length=null", "entropy_of_skipped=false"),
    "packed": ("skip_zero_advantage=true", "pack_length=128", "entropy_of_skipped=true"),
    "shared": ("skip_zero_advantage=true", "pack_length=128", "entropy_of_skipped=true"),
}
SHARED = {"preset": "false", "packed": "false", "shared": "true"}  # learner.share_prompts
READ = ("time/forward_backward_s", "time/entropy_of_skipped_s", "time/step_seconds", "loss/padding_share")


def probe(name: str, steps: int, where: Path) -> dict[str, float]:
    """One `sparkrl up` of `steps` steps under variant `name`: the medians of its steps after the first."""
    run_dir = where / name
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--preset", "explore-wide", "--overwrite"]
    shared = f"share_prompts={SHARED[name]}"
    overrides = (f"max_steps={steps}", "checkpoint_every=1000", shared, *VARIANTS[name])
    command += ["--run-dir", str(run_dir), *(a for o in overrides for a in ("--set", f"learner.{o}"))]
    where.mkdir(parents=True, exist_ok=True)
    log = where / f"{name}.log"
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=1800)
    if done.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{name}: sparkrl up exited {done.returncode}; {log} ends:\n{tail}")
    rows = [row.metrics for row in read_steps(run_dir).rows][1:]
    if not rows:
        raise SystemExit(f"{name}: no step after the first in {run_dir}/metrics.jsonl")
    out = {key: statistics.median(row.get(key) or 0.0 for row in rows) for key in READ}
    out["skipped_share"] = statistics.median(
        (row.get("loss/skipped_tokens") or 0.0) / max(row.get("rollout/tokens") or 1.0, 1.0) for row in rows
    )
    out["entropy"] = statistics.median(row.get("loss/entropy") or 0.0 for row in rows)
    out["k_neg"] = statistics.median(row.get("loss/k_neg") or 0.0 for row in rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    subprocess.run([sys.executable, "-m", "sparkrl.cli", "build-tiny-model", "--out", ".cache"], cwd=ROOT,
                   check=True, capture_output=True)  # fmt: skip
    measured: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="wide-step-") as tmp:
        for round_ in range(args.rounds):
            order = list(VARIANTS) if round_ % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                measured[name].append(probe(name, args.steps, Path(tmp) / f"r{round_}"))
                print(f"round {round_ + 1} {name}: {json.dumps(measured[name][-1])}", flush=True)
    result = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in measured.items()
    }
    base = result["preset"]
    print(f"{'variant':8} {'fwd/bwd s':>10} {'entropy s':>10} {'step s':>8} {'padding':>8} {'skipped':>8}")
    for name, r in result.items():
        times = [r[k] for k in ("time/forward_backward_s", "time/entropy_of_skipped_s", "time/step_seconds")]
        shares = (r["loss/padding_share"], r["skipped_share"])
        print(f"{name:8} {times[0]:10.2f} {times[1]:10.2f} {times[2]:8.2f} {shares[0]:8.1%} {shares[1]:8.1%}")
    ratios = {
        f"ratio_{key.split('/')[1]}_{name}": base[key] / max(r[key], 1e-9)
        for name, r in result.items()
        if name != "preset"
        for key in ("time/forward_backward_s", "time/step_seconds")
    }
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}x")
    print(json.dumps({"steps": args.steps, "rounds": args.rounds, "variants": result} | ratios))


if __name__ == "__main__":
    main()
