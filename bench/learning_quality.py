"""Does Lp-Reg keep the model exploring? GRPO, its entropy-preserving fixes and Lp-Reg on one preset, a few
seeds each, equal compute (same prompts, steps and evaluation), one run after another.

    python bench/learning_quality.py            # configs/explore.yaml, 7 losses × 3 seeds (~50 min here)
    python bench/learning_quality.py --quick    # the smoke scale: the whole pipeline in ~3 minutes
    python bench/learning_quality.py --wide     # the paper's tokens per step (learning_quality_wide.py)

Each run is a real `sparkrl up` (learner, worker, reward service, Redis) with the in-training evaluator
(`eval.every`): held-out pass@1/pass@8/greedy per evaluated version land in RUN/eval.jsonl, the step rows
(entropy, low-probability share, regularized tokens) in RUN/metrics.jsonl. This script reads them back and
writes OUT/report.md (a table, mean ± std over seeds) and PNG plots (one line per loss, seeds shaded), then
prints one JSON line. Every loss runs with its own defaults (verl's and the Lp-Reg authors'); the preset is
the only tuning, and it is the same for all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from lq_verdict import LABELS, mean_std, verdict

from sparkrl.proto.telemetry import EvalRecord
from sparkrl.run_files import read_evals, read_steps

ROOT = Path(__file__).resolve().parents[1]
LOSSES = ("grpo", "entropy_bonus", "clip_higher", "eighty_twenty", "kl_cov", "clip_cov", "lp_reg")
RUN_TIMEOUT_S = 1800
MID_WINDOW = (31, 150)  # steps (1-based, inclusive) of the fixed mid-run entropy window
WALL_FILE = "experiment.json"  # in the runs folder: the experiment's wall time, for --report-only
# The section `--wide` writes into the same report.md (learning_quality_wide.py); a rewrite here keeps it.
WIDE_BEGIN = "<!-- explore-wide: begin (written by bench/learning_quality.py --wide) -->"
WIDE_END = "<!-- explore-wide: end -->"

# Measured while choosing configs/explore.yaml (not rerun by this script; each line gives its command).
REGIMES_TRIED = """\
- **A harder task with its own model** (`build_tiny_model` with a 3-layer, 192-wide model warmed up on 3-4
  numbers up to 12): the sampled reward reached only 0.02 after 1500 warm-up steps (4 minutes here): too
  little signal for RL in a run this size. Dropped for the tiny model on three-number problems (0.07 /
  0.41 pass@1 / pass@8 before RL).
- **Lp-Reg at ρ = 1%, κ = 2%** (the paper's defaults; `sparkrl up --preset explore --set learner.loss.rho=0.01
  --set learner.proxy_kappa=0.02`): k = 3-6 candidate tokens per step, of which 0-2 passed the min-p
  filter and were regularized; entropy 0.88 → 0.29 by step 136, like GRPO's (0.87 → 0.45 by step 91 in
  the same probe). Lp-Reg was GRPO in all but name, so the experiment runs it at ρ = 2%, κ = 1%, the ends
  of the paper's ranges that regularize the most: about 5 tokens a step of ~2,100 generated.
- **Why so few**: a step here has ~2,100 generated tokens, of which only ~400-900 have A < 0 (groups whose
  8-16 answers all fail have A = 0), and the lowest-probability ones are mostly below the min-p cut (noise
  by the proxy's definition). The paper's regime has ~30k-token micro-batches and completions of thousands
  of tokens; a CPU run in this budget cannot reach it.
"""


@dataclass(frozen=True)
class Scale:
    preset: str
    steps: int
    seeds: tuple[int, ...]
    eval_every: int
    eval_problems: int
    eval_n: int
    overrides: tuple[str, ...] = field(default=())


FULL = Scale("explore", steps=150, seeds=(0, 1, 2), eval_every=25, eval_problems=256, eval_n=8)
QUICK = Scale(
    "smoke", steps=4, seeds=(0,), eval_every=2, eval_problems=16, eval_n=4, overrides=("workers=1",)
)


@dataclass
class Run:
    loss: str
    seed: int
    steps: list[dict[str, float | None]]  # metrics per step, in step order
    evals: list[EvalRecord]  # by version
    seconds: float


def up_command(
    loss: str, seed: int, scale: Scale, run_dir: Path, extra: tuple[str, ...] = (), start: str = "--overwrite"
) -> list[str]:
    """The `sparkrl up` of one run: `start` is `--overwrite` (a fresh run) or `--resume`."""
    overrides = [
        f"learner.loss.name={loss}",
        f"learner.max_steps={scale.steps}",
        f"learner.seed={seed}",
        f"prompts.seed={seed + 1}",  # a seed's prompts are the same for every loss
        f"eval.every={scale.eval_every}",
        f"eval.problems={scale.eval_problems}",
        f"eval.n={scale.eval_n}",
        *scale.overrides,
        *extra,  # after the loss name: a loss parameter must belong to the loss chosen
    ]
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--preset", scale.preset, "--run-dir", str(run_dir)]
    return [*command, start, *(arg for o in overrides for arg in ("--set", o))]


def run_one(loss: str, seed: int, scale: Scale, runs: Path) -> Run:
    run_dir = runs / f"{loss}-s{seed}"
    command = up_command(loss, seed, scale, run_dir)
    log_path = runs / f"{loss}-s{seed}.log"
    started = time.perf_counter()
    with log_path.open("w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=RUN_TIMEOUT_S)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise SystemExit(f"{loss} seed {seed} failed (exit {done.returncode}); {log_path} ends:\n{tail}")
    return read_run(loss, seed, runs, seconds)


def read_run(loss: str, seed: int, runs: Path, seconds: float) -> Run:
    run_dir = runs / f"{loss}-s{seed}"
    steps = [row.metrics for row in read_steps(run_dir).rows]
    return Run(loss, seed, steps, read_evals(run_dir), seconds)


def _series(run: Run, name: str) -> np.ndarray:
    return np.array([np.nan if row.get(name) is None else row[name] for row in run.steps], dtype=float)


def _smooth(values: np.ndarray, width: int) -> np.ndarray:
    if width <= 1 or len(values) < width:
        return values
    kernel = np.ones(width) / width
    padded = np.concatenate([np.full(width - 1, values[0]), values])
    return np.convolve(padded, kernel, mode="valid")


def summarize(runs: list[Run], n: int) -> dict[str, dict[str, float]]:
    """Per run, the table's numbers; the last evaluation is the final model's."""
    out = {}
    for run in runs:
        raw = _series(run, "loss/entropy")
        entropy = _smooth(raw, 5)
        tail = max(1, len(entropy) // 10)
        final = run.evals[-1]
        out[f"{run.loss}-s{run.seed}"] = {
            "pass@1": final.pass_at["1"],
            f"pass@{n}": final.pass_at[str(n)],
            "greedy": final.greedy,
            "entropy_first": float(np.nanmean(entropy[:tail])),
            "entropy_final": float(np.nanmean(entropy[-tail:])),
            "entropy_min": float(np.nanmin(entropy)),
            # Before any update acts (step 1's forward is the initial model's): no loss can move it.
            "entropy_step1": float(raw[0]) if len(raw) else float("nan"),
            "entropy_mid": float(np.nanmean(raw[MID_WINDOW[0] - 1 : MID_WINDOW[1]]))
            if len(raw)
            else float("nan"),
            "reg_tokens": float(np.nanmean(np.nan_to_num(_series(run, "loss/reg_tokens")))),
            "neg_tokens_k": float(np.nanmean(np.nan_to_num(_series(run, "loss/k_neg")))),
            "low_prob_share": float(np.nanmean(_series(run, "explore/low_prob_share"))),
            "tokens": float(np.nanmean(_series(run, "rollout/tokens"))),
            "version": final.policy_version,
        }
    return out


def table(
    per_run: dict[str, dict[str, float]], losses: tuple[str, ...], seeds: tuple[int, ...], n: int
) -> str:
    columns = ["pass@1", f"pass@{n}", "greedy", "entropy_final", "entropy_min", "reg_tokens"]
    head = "| loss | held-out pass@1 | pass@" + str(n) + " | greedy | entropy (final) | entropy (min) |"
    lines = [head + " regularized tokens / step |", "|---" * 7 + "|"]
    for loss in losses:
        cells = []
        for column in columns:
            mean, std = mean_std([per_run[f"{loss}-s{s}"][column] for s in seeds])
            digits = 1 if column == "reg_tokens" else 3
            cells.append(f"{mean:.{digits}f} ± {std:.{digits}f}")
        lines.append(f"| {LABELS[loss]} (`{loss}`) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plots(runs: list[Run], losses: tuple[str, ...], out: Path, n: int, prefix: str = "") -> list[str]:
    """The curves, one PNG each, named `prefix` + heldout_pass / entropy / low_prob_share .png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(losses, plt.get_cmap("tab10").colors, strict=False))
    by_loss = {loss: [r for r in runs if r.loss == loss] for loss in losses}
    written = []

    def band(ax: plt.Axes, loss: str, xs: np.ndarray, curves: list[np.ndarray]) -> None:
        stack = np.vstack(curves)
        lw = 2.4 if loss == "lp_reg" else 1.3
        ax.plot(xs, np.nanmean(stack, axis=0), color=colors[loss], lw=lw, label=LABELS[loss])
        ax.fill_between(
            xs, np.nanmin(stack, axis=0), np.nanmax(stack, axis=0), color=colors[loss], alpha=0.12
        )

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, k in zip(axes, ("1", str(n)), strict=True):
        grid = np.array(sorted({e.policy_version for r in runs for e in r.evals}), dtype=float)
        for loss, group in by_loss.items():
            curves = [
                np.interp(grid, [e.policy_version for e in r.evals], [e.pass_at[k] for e in r.evals])
                for r in group
            ]
            band(ax, loss, grid, curves)
        ax.set(xlabel="step (policy version)", ylabel=f"held-out pass@{k}", title=f"Held-out pass@{k}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    written.append(_save(fig, out / f"{prefix}heldout_pass.png"))

    for name, metric, ylabel in (
        ("entropy.png", "loss/entropy", "token entropy of the sampled responses (nats)"),
        ("low_prob_share.png", "explore/low_prob_share", "share of sampled tokens with p < 0.1"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        for loss, group in by_loss.items():
            curves = [_smooth(_series(r, metric), 5) for r in group]
            width = min(len(c) for c in curves)
            band(ax, loss, np.arange(1, width + 1), [c[:width] for c in curves])
        ax.set(xlabel="step", ylabel=ylabel, title=ylabel.split(" (")[0].capitalize() + " (5-step mean)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written.append(_save(fig, out / f"{prefix}{name}"))
    return written


def _save(fig: object, path: Path) -> str:
    fig.tight_layout()  # type: ignore[attr-defined]
    fig.savefig(path, dpi=110)  # type: ignore[attr-defined]
    import matplotlib.pyplot as plt

    plt.close(fig)  # type: ignore[arg-type]
    return path.name


def write_report(runs: list[Run], scale: Scale, losses: tuple[str, ...], out: Path, wall_s: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    n = scale.eval_n
    per_run = summarize(runs, n)
    images = plots(runs, losses, out, n)
    command = "python bench/learning_quality.py" + (" --quick" if scale is QUICK else "")
    text = [
        "# Learning quality: Lp-Reg against GRPO and its entropy-preserving fixes",
        "",
        f"Written by `{command}` ({wall_s / 60:.1f} minutes on this machine). Preset "
        f"`configs/{scale.preset}.yaml`, {scale.steps} steps, seeds {list(scale.seeds)}; Lp-Reg with the "
        "preset's ρ and κ, every baseline with its defaults (`services/common/settings/losses.py`). "
        f"Held-out evaluation: {scale.eval_problems} problems of the "
        f"countdown held-out split at the preset's difficulty, {n} samples at T = 1 and one greedy answer, "
        f"by the in-training evaluator every {scale.eval_every} versions and on the final one.",
        "",
        "## Verdict",
        "",
        verdict(per_run, losses, scale.seeds),
        "",
        f"## Final models (mean ± std over {len(scale.seeds)} seeds)",
        "",
        table(per_run, losses, scale.seeds, n),
        "",
        "Entropy: the learner's mean token entropy on each step's sampled responses (5-step mean; final = "
        "the last tenth of the run). Regularized tokens: Lp-Reg's kl3 term, per step (0 for the others).",
        "",
        "## Curves",
        "",
        *(f"![{name}]({name})" for name in images),
        "",
        "## Regimes tried",
        "",
        REGIMES_TRIED,
        "## Every run",
        "",
        "| run | pass@1 | pass@" + str(n) + " | greedy | entropy first → final | k (A<0) | tokens/step |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {key} | {v['pass@1']:.3f} | {v[f'pass@{n}']:.3f} | {v['greedy']:.3f} | "
            f"{v['entropy_first']:.3f} → {v['entropy_final']:.3f} | {v['neg_tokens_k']:.1f} | "
            f"{v['tokens']:.0f} |"
            for key, v in per_run.items()
        ),
        "",
    ]
    (out / "report.md").write_text("\n".join(text) + wide_section(out / "report.md"))
    return {"report": str(out / "report.md"), "runs": per_run, "minutes": round(wall_s / 60, 1)}


def wide_section(report: Path) -> str:
    """The `--wide` section of `report` with its markers (empty when it has none)."""
    text = report.read_text() if report.is_file() else ""
    if WIDE_BEGIN not in text or WIDE_END not in text:
        return ""
    return "\n" + WIDE_BEGIN + text.split(WIDE_BEGIN, 1)[1].split(WIDE_END, 1)[0] + WIDE_END + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="The smoke scale: every loss, one seed, 4 steps."
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="Report folder (default docs/learning-quality)."
    )
    parser.add_argument(
        "--runs", type=Path, default=None, help="Run folders (default runs/learning-quality)."
    )
    parser.add_argument("--losses", nargs="+", default=None, choices=LOSSES, help="(default: all)")
    parser.add_argument(
        "--seeds", type=int, default=None, help="How many seeds (default 3; --quick 1, --wide 2)."
    )
    parser.add_argument("--steps", type=int, default=None, help="Steps per run (default: the scale's).")
    parser.add_argument(
        "--report-only", action="store_true", help="Write the report from the runs already in --runs."
    )
    parser.add_argument(
        "--wide", action="store_true", help="configs/explore-wide.yaml (learning_quality_wide.py)."
    )
    import learning_quality_wide as wide  # imports this module: only here, not at the top

    wide.add_arguments(parser)
    args = parser.parse_args()
    if args.wide:
        wide.run_wide(args)
        return
    scale = QUICK if args.quick else FULL
    if args.seeds is not None or args.steps is not None:
        seeds = tuple(range(args.seeds)) if args.seeds is not None else scale.seeds
        scale = Scale(**{**scale.__dict__, "seeds": seeds, "steps": args.steps or scale.steps})
    out = args.out or ROOT / ("runs/learning-quality-quick/report" if args.quick else "docs/learning-quality")
    runs_dir = args.runs or ROOT / ("runs/learning-quality-quick" if args.quick else "runs/learning-quality")
    runs_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    subprocess.run([sys.executable, "-m", "sparkrl.cli", "build-tiny-model", "--out", ".cache"], cwd=ROOT,
                   check=True, capture_output=True)  # fmt: skip
    losses, started, runs = tuple(args.losses or LOSSES), time.perf_counter(), []
    total = len(losses) * len(scale.seeds)
    for seed in scale.seeds:  # seed-major: a stopped experiment still has every loss for the first seeds
        for loss in losses:
            run = (
                read_run(loss, seed, runs_dir, 0.0)
                if args.report_only
                else run_one(loss, seed, scale, runs_dir)
            )
            runs.append(run)
            final = run.evals[-1]
            print(f"[{len(runs)}/{total}] {loss} seed {seed}: {run.seconds:.0f}s, version "
                  f"{final.policy_version} pass@1 {final.pass_at['1']:.3f}, "
                  f"{(time.perf_counter() - started) / 60:.1f} min so far", flush=True)  # fmt: skip
    wall_s = time.perf_counter() - started
    wall_file = runs_dir / WALL_FILE
    if args.report_only and wall_file.is_file():
        wall_s = json.loads(wall_file.read_text())["seconds"]  # the experiment's, not this rewrite's
    elif not args.report_only:
        wall_file.write_text(json.dumps({"seconds": wall_s}))
    summary = write_report(runs, scale, losses, out, wall_s)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
