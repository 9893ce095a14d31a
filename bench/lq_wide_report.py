"""The `--wide` section of report.md, written from the runs' records alone (lq_records.py): a fresh clone
with the committed records writes the same section, and with some runs still to come it says how many
are in and that its verdict is preliminary."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import yaml
from learning_quality import (
    WIDE_BEGIN,
    WIDE_END,
    Run,
    Scale,
    _series,
    plots,
    summarize,
    table,
)
from lq_caveats import async_line, reach_line
from lq_dose import dose_line, dose_plot, dose_rows
from lq_records import CONFIG_DIR, read_record_steps
from lq_settings import settings_line, staleness_line
from lq_verdict import LABELS, entropy_sentence, outcome_line, verdict

from sparkrl.proto.telemetry import StepMetrics
from sparkrl.run_files import read_evals

if TYPE_CHECKING:
    from learning_quality_wide import Spec  # which imports this module

K_TARGET = 20  # the floor for k per micro-batch at ρ = 1%


def read_record(spec: Spec, records: Path) -> Run:
    """The run's step rows and evaluations from its record; `seconds`: its training time."""
    rows = read_record_steps(records / spec.name).rows
    steps = [row.metrics for row in rows]
    return Run(spec.loss, spec.seed, steps, read_evals(records / spec.name), step_seconds(rows)[1])


def step_seconds(rows: list[StepMetrics]) -> tuple[float, float]:
    """(a step's wall time, the run's) from its step rows' times: the median gap, and the sum of the gaps
    with a resume's pause (over 10 × the median) counted as one median step. Start-up is left out."""
    if len(rows) < 2:
        return float("nan"), 0.0
    gaps = np.diff([row.time for row in rows])
    median = float(np.median(gaps))
    return median, float(np.where(gaps > 10 * median, median, gaps).sum())


def hparam(record_dir: Path, name: str) -> float:
    """A hyperparameter (`rho`, `kappa`) as the run's first step row records it; 0 when it has none."""
    rows = read_record_steps(record_dir).rows
    value = rows[0].hparams.get(name) if rows else None
    return float(value) if isinstance(value, int | float) else 0.0


def skipping(runs: dict[Spec, Run], records: Path) -> list[str]:
    """The runs whose recorded learner config skipped the A = 0 completions without measuring their
    entropy (`learner.skip_zero_advantage` on, `learner.entropy_of_skipped` off): their `loss/entropy`
    is over the trained tokens only."""
    on = []
    for spec in runs:
        learner = learner_config(records / spec.name)
        if learner.get("skip_zero_advantage", True) and not learner.get("entropy_of_skipped", False):
            on.append(spec.name)
    return on


def max_staleness(records: Path) -> int | None:
    """`learner.max_staleness` as the first recorded run's config has it (the series shares it)."""
    for record in sorted(records.iterdir()) if records.is_dir() else []:
        if (record / CONFIG_DIR / "learner.yaml").is_file():
            value = learner_config(record).get("max_staleness")
            return int(value) if value is not None else None
    return None


def learner_config(record_dir: Path) -> dict:
    """The `learner:` block of the run's recorded learner.yaml."""
    config = yaml.safe_load((record_dir / CONFIG_DIR / "learner.yaml").read_text()) or {}
    return config.get("learner") or {}


def sampling_text(runs: dict[Spec, Run], records: Path) -> str:
    """How the runs' steps were filled: dynamic sampling or not (each run's recorded config), and the
    share of the groups sampled that dynamic sampling set aside (`rollout/filtered_share`, per step)."""
    filtering = [s for s in runs if learner_config(records / s.name).get("filter_groups", "none") != "none"]
    if not filtering:
        return "every step trains the groups sampled, however many scored alike (no dynamic sampling)"
    shares = [float(np.nanmean(np.nan_to_num(_series(runs[s], "rollout/filtered_share")))) for s in filtering]
    said = "every loss" if len(filtering) == len(runs) else ", ".join(s.name for s in filtering)
    low, high = f"{min(shares):.0%}", f"{max(shares):.0%}"
    share = low if low == high else f"{low}–{high}"
    return (
        f"dynamic sampling for {said} (`learner.filter_groups: zero_variance`, DAPO's filter): a group whose "
        "answers all score alike carries no gradient and does not count toward a step, so every step trains "
        f"its full batch of informative groups; {share} of the groups sampled were set aside (mean per step"
        f"{', by run' if len(filtering) > 1 else ''}), and `loss/entropy` is over the groups trained"
    )


def per_spec(runs: dict[Spec, Run], records: Path, n: int) -> dict[str, dict[str, float]]:
    """The table's numbers per run (learning_quality.summarize's), with k per micro-batch and step time.
    `loss/k_neg` is the token-weighted mean of the step's micro-batches' k: at this preset's one
    micro-batch a step, that micro-batch's k (and the step's)."""
    out = {}
    for spec, run in runs.items():
        row = next(iter(summarize([run], n).values()))
        k = _series(run, "loss/k_neg")
        has_k = not np.isnan(k).all()  # Lp-Reg's; the other losses have no k and regularize nothing
        k = k[~np.isnan(k)] if has_k else np.zeros(1)
        row |= {
            "has_k": float(has_k),
            "k_min": float(k.min()),
            "k_median": float(np.median(k)),
            "k_mean": float(k.mean()),
            "steps": float(len(run.steps)),
            "step_s": step_seconds(read_record_steps(records / spec.name).rows)[0],
            "train_s": run.seconds,
            # Over step 1 (the initial model, before any update): an early effect cannot invert it.
            "entropy_kept": row["entropy_final"] / row["entropy_step1"] if row["entropy_step1"] else 0.0,
            "staleness": float(np.nanmean(_series(run, "rollout/staleness_mean"))),
        }
        out[spec.name] = row
    return out


def compared(
    runs: dict[Spec, Run], losses: tuple[str, ...], seeds: tuple[int, ...]
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The losses and seeds the table and the verdict compare (they need every pair): the seeds every
    loss has finished, or, while no seed is complete, the losses of the seed that has the most (the
    first such seed: the plan is seed-major, so the first seed usually fills in first)."""
    have = {(spec.loss, spec.seed) for spec in runs if spec.rho is None}
    full = tuple(seed for seed in seeds if all((loss, seed) in have for loss in losses))
    if full:
        return losses, full
    most = max(seeds, key=lambda seed: sum((loss, seed) in have for loss in losses))
    return tuple(loss for loss in losses if (loss, most) in have), (most,)


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


def run_rows(stats: dict[str, dict[str, float]], n: int) -> list[str]:
    head = "| run | steps | median s / step | wall, all steps (min) | pass@1 | pass@" + str(n) + " | greedy |"
    lines = [
        head + " entropy first → final | k / micro-batch | reg. tokens / step | tokens / step | staleness |"
    ]
    lines.append("|---" * 12 + "|")
    for name, v in stats.items():
        k, reg = (f"{v['k_mean']:.1f}", f"{v['reg_tokens']:.1f}") if v["has_k"] else ("—", "—")
        lines.append(
            f"| {name} | {v['steps']:.0f} | {v['step_s']:.1f} | {v['train_s'] / 60:.0f} | "
            f"{v['pass@1']:.3f} | {v[f'pass@{n}']:.3f} | {v['greedy']:.3f} | {v['entropy_first']:.3f} → "
            f"{v['entropy_final']:.3f} | {k} | {reg} | {v['tokens']:.0f} | {v['staleness']:.2f} |"
        )
    return lines


def preliminary(
    runs: dict[Spec, Run], plan: list[Spec], losses: tuple[str, ...], seeds: tuple[int, ...]
) -> str:
    """The verdict's caveat while runs are still to come; empty once every run is in."""
    missing = [spec.name for spec in plan if spec not in runs]
    if not missing:
        return ""
    compares = ", ".join(LABELS[loss] for loss in losses) or "no loss yet"
    return (
        f"**Preliminary: {len(plan) - len(missing)} of {len(plan)} runs are in** (to come: "
        f"{', '.join(missing)}); this compares {compares} on seed{'s' if len(seeds) > 1 else ''} "
        f"{', '.join(map(str, seeds))} only. "
    )


def intro(runs: dict[Spec, Run], plan: list[Spec], scale: Scale, records: Path, quick: bool) -> list[str]:
    """The section's heading and its first paragraph: what ran, how, and how many runs are in."""
    n, seeds = scale.eval_n, scale.seeds
    losses = tuple(dict.fromkeys(spec.loss for spec in plan if spec.rho is None))
    at_preset = [spec for spec in runs if spec.loss == "lp_reg" and spec.rho is None]
    lp = records / at_preset[0].name if at_preset else None
    lp_text = f"ρ = {hparam(lp, 'rho'):.0%}, κ = {hparam(lp, 'kappa'):.0%}" if lp else "—"
    on = skipping(runs, records)
    entropy_text = (
        "every loss's `loss/entropy` over every token of its step (`learner.skip_zero_advantage: false`, "
        "or on with `learner.entropy_of_skipped`, in every run's config/learner.yaml)"
        if not on
        else f"**A = 0 completions skipped unmeasured in {', '.join(on)}**: their entropy is over A ≠ 0 "
        "tokens (`learner.skip_zero_advantage` on, `learner.entropy_of_skipped` off)"
    )
    hours = sum(run.seconds for run in runs.values()) / 3600
    command = "python bench/learning_quality.py --wide" + (" --quick" if quick else "")
    partial = "" if len(runs) == len(plan) else f" ({len(runs)} of {len(plan)} runs)"
    return [
        f"## At the paper's tokens per step: `configs/{scale.preset}.yaml`{partial}",
        "",
        f"Written by `{command}` from the runs' records (`{records.name}/RUN/` beside this report: "
        f"{len(runs)} of {len(plan)} runs, {hours:.1f} hours of runs on this machine). {scale.steps} steps, "
        f"seeds {list(seeds)}; {', '.join(LABELS[x] for x in losses)}: every loss with its defaults and the "
        f"preset's settings, Lp-Reg at the preset's {lp_text} (the paper's defaults: nothing tuned for it); "
        f"{entropy_text}; {sampling_text(runs, records)}. Held-out evaluation: {scale.eval_problems} "
        f"problems, {n} samples at T = 1 and greedy, every {scale.eval_every} versions and on the final one.",
    ]


def compared_runs(
    runs: dict[Spec, Run], plan: list[Spec], scale: Scale, records: Path
) -> tuple[tuple[str, ...], tuple[int, ...], list[Spec], list[tuple[float, Spec]]]:
    """What a series' verdict compares: its losses and seeds (`compared`), Lp-Reg's runs at the preset's
    ρ, and its dose-response points (ρ, run) on the first seed, by ρ."""
    losses, seeds = compared(runs, tuple(dict.fromkeys(s.loss for s in plan if s.rho is None)), scale.seeds)
    at_preset = [spec for spec in runs if spec.loss == "lp_reg" and spec.rho is None]
    on_first = [spec for spec in runs if spec.loss == "lp_reg" and spec.seed == scale.seeds[0]]
    dose = sorted(((hparam(records / s.name, "rho"), s) for s in on_first), key=lambda p: p[0])
    return losses, seeds, at_preset, dose


def paragraphs(*texts: str) -> list[str]:
    """Markdown paragraphs of the non-empty texts, blank lines between."""
    said = [text.strip() for text in texts if text.strip()]
    return [line for text in said for line in (text, "")][:-1]


def wide_report(
    runs: dict[Spec, Run], plan: list[Spec], scale: Scale, records: Path, out: Path, quick: bool
) -> tuple[str, dict[str, dict[str, float]]]:
    """The section's markdown (its images written to `out`) and the numbers per run, from the records
    of `runs` (those of `plan` that are in)."""
    if not runs:  # only an earlier series is in: this one's plan and where its records will go
        return "\n".join([
            f"## At the paper's tokens per step: `configs/{scale.preset}.yaml` (0 of {len(plan)} runs)",
            "",
            f"No run of this series is recorded yet (its records go to `{records.name}/RUN/` beside this "
            f"report; `python bench/learning_quality.py --wide` runs them: "
            f"{', '.join(s.name for s in plan)}).",
        ]), {}  # fmt: skip
    n = scale.eval_n
    stats = per_spec(runs, records, n)
    losses, seeds, at_preset, dose_points = compared_runs(runs, plan, scale, records)
    main = [run for spec, run in runs.items() if spec.rho is None and spec.loss in losses]
    images = plots(main, losses, out, n, prefix="wide_")
    if dose_points:
        first = dose_points[0][1].seed
        same_seed = [f"{x}-s{first}" for x in losses if x != "lp_reg" and f"{x}-s{first}" in stats]
        images.append(dose_plot(stats, dose_points, same_seed, out))
    # Over two seeds or more the outcome line states the pass@1 comparison; the verdict adds the rest.
    said = verdict(stats, losses, seeds) if len(seeds) < 2 else entropy_sentence(stats, losses, seeds)
    runs_by_name = {spec.name: run for spec, run in runs.items()}
    text = [
        *intro(runs, plan, scale, records, quick),
        "",
        "### Verdict",
        "",
        *paragraphs(
            preliminary(runs, plan, losses, seeds) + outcome_line(stats, losses, seeds) + said,
            reach_line({s.name: runs[s] for s in at_preset})
            + async_line(runs_by_name, max_staleness(records)),
            k_line(stats, at_preset) + dose_line(stats, dose_points, losses, scale.seeds[0]),
            settings_line({s.name: (s.seed, records / s.name) for s in runs}) + staleness_line(stats),
        ),
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
        "the run's entropy over its step 1 (the initial model's, before any update acted). Entropy, steps "
        "31–150: the mean `loss/entropy` over that fixed window.",
        "",
        "### Curves",
        "",
        *(f"![{name}]({name})" for name in images),
        "",
        "### Every run",
        "",
        *run_rows(stats, n),
        "",
        "Median s / step: the median gap between two step rows. Wall, all steps: the sum of those gaps "
        "(start-up left out, a resume's pause counted as one median step); with dynamic sampling the late "
        "steps wait longest on data, so it is more than steps × the median. Tokens / step: `rollout/tokens`, "
        "the generated tokens of the groups a step trained (set-aside groups not counted). Staleness: "
        "`rollout/staleness_mean`, the policy versions a trained group lagged the learner, mean over steps "
        "(bounded by `learner.max_staleness`; a faster fleet, from a later checkout, can shift it).",
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
