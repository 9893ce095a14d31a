"""Learning quality at the paper's tokens per step (`python bench/learning_quality.py --wide`).

    python bench/learning_quality.py --wide          # configs/explore-wide.yaml: 8 runs of 300 steps
    python bench/learning_quality.py --wide --quick  # the smoke scale: the same pipeline in minutes

The runs, seed-major: Lp-Reg (the preset's ρ = 1%, κ = 2%), GRPO and KL-Cov (the best baseline of the
`explore` report) at seeds 1 and 2; then Lp-Reg's dose response on seed 1 at ρ = 3% and 10% (ρ = 1% is
lp_reg-s1). Every other setting is the preset's, the same for every loss. Held-out evaluation every 50
versions and on the final one (RUN/eval.jsonl), the step rows in RUN/metrics.jsonl.

Resumable: a run whose folder holds the summary `sparkrl up` writes at its end, at the last step, and an
evaluation of that version is kept; a run cut short goes on from its last checkpoint (`sparkrl up
--resume`: the journal replays the steps after it) or, without one, is redone. A killed experiment
started again continues from the runs already finished.

The report is one section of OUT/report.md between markers (`WIDE_BEGIN` / `WIDE_END`): written anew on
each pass, the rest of the file kept. Its figures come from the runs' files only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from learning_quality import (
    LABELS,
    ROOT,
    WIDE_BEGIN,
    WIDE_END,
    Run,
    Scale,
    _save,
    _series,
    plots,
    summarize,
    table,
    up_command,
    verdict,
)

from sparkrl.run_files import SUMMARY_FILE, read_evals, read_steps

WIDE = Scale("explore-wide", steps=300, seeds=(1, 2), eval_every=50, eval_problems=256, eval_n=8)
WIDE_QUICK = Scale(
    "smoke",
    steps=4,
    seeds=(1,),
    eval_every=2,
    eval_problems=16,
    eval_n=4,
    overrides=("workers=1", "learner.skip_zero_advantage=false"),
)
WIDE_LOSSES = ("lp_reg", "grpo", "kl_cov")  # Lp-Reg, its baseline, the best baseline of the explore report
DOSE_RHOS = (0.03, 0.10)  # besides the preset's ρ = 1%, on the first seed
RUN_TIMEOUT_S = 6 * 3600  # one run is about an hour here
PROGRESS_EVERY_S = 60.0
K_TARGET = 20  # the floor for k per micro-batch at ρ = 1%


@dataclass(frozen=True)
class Spec:
    """One run of the experiment: a loss, a seed and, for the dose response, Lp-Reg's ρ."""

    loss: str
    seed: int
    rho: float | None = None  # None: the preset's

    @property
    def name(self) -> str:
        return f"{self.loss}{'' if self.rho is None else f'-rho{self.rho:.2f}'}-s{self.seed}"

    @property
    def extra(self) -> tuple[str, ...]:
        return () if self.rho is None else (f"learner.loss.rho={self.rho}",)


def specs(losses: tuple[str, ...], seeds: tuple[int, ...], rhos: tuple[float, ...]) -> list[Spec]:
    """Seed-major, the dose runs last: a stopped experiment has every loss of its first seeds."""
    plan = [Spec(loss, seed) for seed in seeds for loss in losses]
    return plan + ([Spec("lp_reg", seeds[0], rho) for rho in rhos] if "lp_reg" in losses else [])


def finished(run_dir: Path, steps: int) -> bool:
    """`sparkrl up` summarized the run at its last step and the evaluator saw that version."""
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return False
    evals = read_evals(run_dir)
    return summary.get("steps", 0) >= steps and bool(evals) and evals[-1].policy_version >= steps


def run_spec(spec: Spec, scale: Scale, runs: Path) -> None:
    """Runs `spec` to its end: resumed from its last checkpoint, or from the start without one (or when
    the resume fails)."""
    run_dir = runs / spec.name
    start = "--resume" if (run_dir / "checkpoints" / "latest").exists() else "--overwrite"
    said = "started" + (" again from step 0 (no checkpoint)" if run_dir.is_dir() else "")
    print(f"  {spec.name}: {'resumed from its last checkpoint' if start == '--resume' else said}", flush=True)
    code = launch(spec, scale, runs, start)
    if code != 0 and start == "--resume":
        print(f"  {spec.name}: the resume failed (exit {code}); redone from step 0", flush=True)
        code = launch(spec, scale, runs, "--overwrite")
    if code != 0 or not finished(run_dir, scale.steps):
        log = runs / f"{spec.name}.log"
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{spec.name} did not finish (exit {code}); {log} ends:\n{tail}")


def launch(spec: Spec, scale: Scale, runs: Path, start: str) -> int:
    """One `sparkrl up`, a progress line a minute; its exit code (SIGTERM after RUN_TIMEOUT_S)."""
    run_dir, log_path = runs / spec.name, runs / f"{spec.name}.log"
    command = up_command(spec.loss, spec.seed, scale, run_dir, spec.extra, start)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    with (
        log_path.open("a") as log,
        subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT) as child,
    ):
        while True:
            try:
                return child.wait(timeout=PROGRESS_EVERY_S)
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    child.send_signal(signal.SIGTERM)  # `sparkrl up` stops its stack tier by tier
                    return child.wait()
                print(progress(spec.name, run_dir, scale.steps), flush=True)


def progress(name: str, run_dir: Path, steps: int) -> str:
    rows = read_steps(run_dir).rows
    if len(rows) < 2:
        return f"  {name}: starting"
    recent = rows[-20:]
    per_step = (recent[-1].time - recent[0].time) / (len(recent) - 1)
    left = (steps - rows[-1].step) * per_step / 60
    return f"  {name}: step {rows[-1].step}/{steps}, {per_step:.1f} s a step, ~{left:.0f} min left"


def read_spec(spec: Spec, runs: Path) -> Run:
    """The run's step rows and evaluations; `seconds`: its training time (`step_seconds`)."""
    run_dir = runs / spec.name
    rows = read_steps(run_dir).rows
    steps = [row.metrics for row in rows]
    return Run(spec.loss, spec.seed, steps, read_evals(run_dir), step_seconds([r.time for r in rows])[1])


def step_seconds(times: list[float]) -> tuple[float, float]:
    """(a step's wall time, the run's) from its step rows' times: the median gap, and the sum of the gaps
    with a resume's pause (over 10 × the median) counted as one median step. Start-up is left out."""
    if len(times) < 2:
        return float("nan"), 0.0
    gaps = np.diff(times)
    median = float(np.median(gaps))
    return median, float(np.where(gaps > 10 * median, median, gaps).sum())


def hparam(run_dir: Path, name: str) -> float:
    """A hyperparameter (`rho`, `kappa`) as the run's first step row records it; 0 when it has none."""
    rows = read_steps(run_dir).rows
    value = rows[0].hparams.get(name) if rows else None
    return float(value) if isinstance(value, int | float) else 0.0


def skipping(runs: dict[Spec, Run], runs_dir: Path) -> list[str]:
    """The runs whose written config (RUN/config/learner.yaml) left `learner.skip_zero_advantage` on."""
    on = []
    for spec in runs:
        config = yaml.safe_load((runs_dir / spec.name / "config" / "learner.yaml").read_text()) or {}
        if (config.get("learner") or {}).get("skip_zero_advantage", True):
            on.append(spec.name)
    return on


def per_spec(runs: dict[Spec, Run], runs_dir: Path, n: int) -> dict[str, dict[str, float]]:
    """The table's numbers per run (learning_quality.summarize's), with k per micro-batch and step time.
    `loss/k_neg` is the token-weighted mean of the step's micro-batches' k: at this preset's one
    micro-batch a step, that micro-batch's k (and the step's)."""
    out = {}
    for spec, run in runs.items():
        row = next(iter(summarize([run], n).values()))
        k = _series(run, "loss/k_neg")
        k = k[~np.isnan(k)] if not np.isnan(k).all() else np.zeros(1)
        row |= {
            "k_min": float(k.min()),
            "k_median": float(np.median(k)),
            "k_mean": float(k.mean()),
            "steps": float(len(run.steps)),
            "step_s": step_seconds([r.time for r in read_steps(runs_dir / spec.name).rows])[0],
            "train_s": run.seconds,
            "entropy_kept": row["entropy_final"] / row["entropy_first"] if row["entropy_first"] else 0.0,
        }
        out[spec.name] = row
    return out


def k_line(stats: dict[str, dict[str, float]], specs_at_preset: list[Spec]) -> str:
    """The issue's must-show: k per micro-batch at ρ = 1%, measured from the step rows."""
    if not specs_at_preset:
        return ""
    low = min(stats[s.name]["k_min"] for s in specs_at_preset)
    median = statistics.median(stats[s.name]["k_median"] for s in specs_at_preset)
    regs = statistics.fmean(stats[s.name]["reg_tokens"] for s in specs_at_preset)
    said = "at every step" if low >= K_TARGET else f"**not** at every step (floor {K_TARGET})"
    return (
        f" Lp-Reg's k per micro-batch at the preset's ρ (`loss/k_neg`; the preset packs a step into one "
        "micro-batch, so it is also the step's k): median "
        f"{median:.0f}, lowest {low:.0f}, ≥ {K_TARGET} {said}; of those candidates {regs:.1f} a step passed "
        "the min-p test and were regularized."
    )


def dose_rows(stats: dict[str, dict[str, float]], dose: list[tuple[float, Spec]], n: int) -> list[str]:
    head = (
        "| ρ | k per micro-batch (mean) | regularized tokens / step | entropy first → final | entropy kept |"
    )
    lines = [head + f" entropy (min) | low-prob share | pass@1 | pass@{n} |", "|---" * 9 + "|"]
    for rho, spec in dose:
        v = stats[spec.name]
        lines.append(
            f"| {rho:.0%} (`{spec.name}`) | {v['k_mean']:.1f} | {v['reg_tokens']:.1f} | "
            f"{v['entropy_first']:.3f} → {v['entropy_final']:.3f} | {v['entropy_kept']:.2f} | "
            f"{v['entropy_min']:.3f} | {v['low_prob_share']:.3f} | {v['pass@1']:.3f} | {v[f'pass@{n}']:.3f} |"
        )
    return lines


def dose_plot(stats: dict[str, dict[str, float]], dose: list[tuple[float, Spec]], out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [stats[s.name]["reg_tokens"] for _, s in dose]
    ys = [stats[s.name]["entropy_kept"] for _, s in dose]
    ax.plot(xs, ys, "o-", color="tab:red")
    for (rho, _), x, y in zip(dose, xs, ys, strict=True):
        ax.annotate(f"ρ = {rho:.0%}", (x, y), textcoords="offset points", xytext=(5, 5))
    ax.set(xlabel="regularized tokens per step", ylabel="entropy kept (final / first)")
    ax.set_title("Lp-Reg's dose response")
    ax.grid(alpha=0.3)
    return _save(fig, out / "wide_dose.png")


def run_rows(stats: dict[str, dict[str, float]], n: int) -> list[str]:
    head = "| run | steps | s / step | training (min) | pass@1 | pass@" + str(n) + " | greedy |"
    lines = [head + " entropy first → final | k / micro-batch | reg. tokens / step | tokens / step |"]
    lines.append("|---" * 11 + "|")
    for name, v in stats.items():
        lines.append(
            f"| {name} | {v['steps']:.0f} | {v['step_s']:.1f} | {v['train_s'] / 60:.0f} | "
            f"{v['pass@1']:.3f} | {v[f'pass@{n}']:.3f} | {v['greedy']:.3f} | {v['entropy_first']:.3f} → "
            f"{v['entropy_final']:.3f} | {v['k_mean']:.1f} | {v['reg_tokens']:.1f} | {v['tokens']:.0f} |"
        )
    return lines


def wide_report(
    runs: dict[Spec, Run], scale: Scale, losses: tuple[str, ...], runs_dir: Path, out: Path, quick: bool
) -> tuple[str, dict[str, dict[str, float]]]:
    """The section's markdown (its images written to `out`) and the numbers per run."""
    n, seeds = scale.eval_n, scale.seeds
    stats = per_spec(runs, runs_dir, n)
    main = [run for spec, run in runs.items() if spec.rho is None]
    at_preset = [spec for spec in runs if spec.loss == "lp_reg" and spec.rho is None]
    on_first = [spec for spec in runs if spec.loss == "lp_reg" and spec.seed == seeds[0]]
    dose_points = sorted(
        ((hparam(runs_dir / spec.name, "rho"), spec) for spec in on_first), key=lambda p: p[0]
    )
    images = plots(main, losses, out, n, prefix="wide_")
    if dose_points:
        images.append(dose_plot(stats, dose_points, out))
    hours = sum(run.seconds for run in runs.values()) / 3600
    command = "python bench/learning_quality.py --wide" + (" --quick" if quick else "")
    lp = runs_dir / at_preset[0].name if at_preset else None
    lp_text = f"ρ = {hparam(lp, 'rho'):.0%}, κ = {hparam(lp, 'kappa'):.0%}" if lp else "—"
    on = skipping(runs, runs_dir)
    entropy_text = (
        "`learner.skip_zero_advantage: false` in every run (RUN/config/learner.yaml), so that every "
        "loss's entropy is over the same tokens"
        if not on
        else f"**`learner.skip_zero_advantage` on in {', '.join(on)}**: their entropy is over A ≠ 0 tokens"
    )
    text = [
        f"## At the paper's tokens per step: `configs/{scale.preset}.yaml`",
        "",
        f"Written by `{command}` from the runs' files ({len(runs)} runs, {hours:.1f} hours of runs on this "
        f"machine). {scale.steps} steps, seeds {list(seeds)}; {', '.join(LABELS[x] for x in losses)}: "
        f"every loss with its defaults and the preset's settings, Lp-Reg at the preset's {lp_text} (the "
        f"paper's defaults: nothing tuned for it); {entropy_text}. Held-out evaluation: "
        f"{scale.eval_problems} problems, {n} samples at T = 1 and greedy, every {scale.eval_every} "
        "versions and on the final one.",
        "",
        "### Verdict",
        "",
        verdict(stats, losses, seeds) + k_line(stats, at_preset),
        "",
        f"### Final models (mean ± std over {len(seeds)} seed{'s' if len(seeds) > 1 else ''})",
        "",
        table(stats, losses, seeds, n),
        "",
        "### Lp-Reg's dose response (one seed)",
        "",
        *dose_rows(stats, dose_points, n),
        "",
        "k per micro-batch: `loss/k_neg` of the step rows (int(N_neg · ρ), counted per micro-batch; a step "
        "with several micro-batches reports their token-weighted mean), mean over steps. Regularized "
        "tokens: `loss/reg_tokens`, summed over a step's micro-batches. Entropy kept: the last tenth of "
        "the run's entropy over the first tenth's.",
        "",
        "### Curves",
        "",
        *(f"![{name}]({name})" for name in images),
        "",
        "### Every run",
        "",
        *run_rows(stats, n),
    ]
    return "\n".join(text), stats


def splice(report: Path, section: str) -> None:
    """`section` between the markers of `report`, in place of the one there; the rest of the file kept."""
    text = report.read_text() if report.is_file() else ""
    block = f"{WIDE_BEGIN}\n{section.strip()}\n{WIDE_END}\n"
    if WIDE_BEGIN in text and WIDE_END in text:
        head, rest = text.split(WIDE_BEGIN, 1)
        text = head + block + rest.split(WIDE_END, 1)[1].lstrip("\n")
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + block
    report.write_text(text)


def run_wide(args: argparse.Namespace) -> None:
    """`learning_quality.py --wide`: the runs not finished yet, then the report section."""
    scale = WIDE_QUICK if args.quick else WIDE
    seeds = tuple(range(1, args.seeds + 1)) if args.seeds else scale.seeds
    scale = Scale(**{**scale.__dict__, "seeds": seeds, "steps": args.steps or scale.steps})
    losses = tuple(args.losses or WIDE_LOSSES)
    rhos = DOSE_RHOS if args.rhos is None else tuple(args.rhos)
    name = "runs/learning-quality-wide" + ("-quick" if args.quick else "")
    runs_dir = args.runs or ROOT / name
    out = args.out or (ROOT / name / "report" if args.quick else ROOT / "docs/learning-quality")
    runs_dir.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    plan, started = specs(losses, seeds, rhos), time.perf_counter()
    todo = [spec for spec in plan if not finished(runs_dir / spec.name, scale.steps)]
    if todo and args.report_only:
        raise SystemExit(f"not finished: {', '.join(s.name for s in todo)} (run without --report-only)")
    if todo:
        subprocess.run([sys.executable, "-m", "sparkrl.cli", "build-tiny-model", "--out", ".cache"], cwd=ROOT,
                       check=True, capture_output=True)  # fmt: skip
    for index, spec in enumerate(plan, 1):
        at = f"[{index}/{len(plan)}] {spec.name}"
        if spec not in todo:
            print(f"{at}: finished before, kept", flush=True)
            continue
        print(at, flush=True)
        run_spec(spec, scale, runs_dir)
        final = read_evals(runs_dir / spec.name)[-1]
        print(f"{at}: done, version {final.policy_version} pass@1 {final.pass_at['1']:.3f}, "
              f"{(time.perf_counter() - started) / 60:.1f} min so far", flush=True)  # fmt: skip
    runs = {spec: read_spec(spec, runs_dir) for spec in plan}
    section, stats = wide_report(runs, scale, losses, runs_dir, out, args.quick)
    splice(out / "report.md", section)
    print(json.dumps({"report": str(out / "report.md"), "runs": stats}))
