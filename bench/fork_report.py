"""The planted fork's verdict (issue 47), from the committed records alone: a section of
docs/learning-quality/report.md between FORK_BEGIN / FORK_END, and two figures beside it.

Each record (bench/fork_experiment.py) holds the run's step rows, held-out evaluations and probe.jsonl:
p(spark) and Z at the fork of every checkpoint, each path's success every 50 steps. The section tests the
predictions pre-registered in the report (above the markers) with the thresholds below, fixed with them:
a seed's spark is *extinguished* when its final p(spark) is below EXTINCT, *kept* when at least KEPT of its
start, and its path has *taken over* when p(spark) ends above TAKEN_OVER. Paired hypotheses compare a
seed's arms on the coarse outcome: lost (extinguished or declining), kept, or taken over.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from lq_records import read_record_steps, recorded_steps

from sparkrl.run_files import read_evals

EXTINCT = 0.005  # final p(spark), against ≈ 0.026 at the start: below a fifth of it
KEPT = 0.5  # final p(spark) at least half its start
TAKEN_OVER = 0.5  # the spark is the model's first choice more often than not
PRECONDITION_STEP = 30  # Z then: the pilots' tails were gone by it (the pull β(1/Z − 1) with them)
ARM_NAMES = {
    "grpo": "GRPO",
    "lpreg-b0": "Lp-Reg β = 0 (clip control)",
    "lpreg": "Lp-Reg β = 1",
    "dppo": "DPPO",
}
BEGIN, END = "<!-- FORK_BEGIN -->", "<!-- FORK_END -->"


def read(record: Path) -> dict[str, Any]:
    """One record: its spec, probe rows, step rows' series and final held-out pass@1."""
    about = json.loads((record / "record.json").read_text())
    probe = [json.loads(line) for line in (record / "probe.jsonl").read_text().splitlines() if line]
    rows = read_record_steps(record).rows
    evals = read_evals(record)

    def series(name: str) -> list[float]:
        return [float(r.metrics.get(name) or 0.0) for r in rows]

    return {
        **about["spec"],
        "start": probe[0],
        "final": probe[-1],
        "probe": probe,
        "reward": series("rollout/reward_mean"),
        "reg_tokens": series("loss/reg_tokens"),
        "tokens": series("rollout/tokens"),
        "masked": [
            a + b
            for a, b in zip(series("loss/masked_pos_tokens"), series("loss/masked_neg_tokens"), strict=True)
        ],
        "heldout": evals[-1].pass_at["1"] if evals else None,
    }


def fate(run: dict[str, Any]) -> str:
    p0, p1 = run["start"]["p_spark"], run["final"]["p_spark"]
    if p1 > TAKEN_OVER:
        return "taken over"
    if p1 < EXTINCT:
        return "extinguished"
    return "kept" if p1 >= KEPT * p0 else "declining"


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def arm_line(condition: str, arm: str, runs: list[dict[str, Any]]) -> str:
    if not runs:
        return f"| {condition} | {ARM_NAMES[arm]} | 0 | — | — | — | — | — | — | — |"
    fates = [fate(r) for r in runs]
    counts = ", ".join(f"{fates.count(f)} {f}" for f in ("extinguished", "declining", "kept", "taken over")
                       if f in fates)  # fmt: skip
    finals = " / ".join(f"{r['final']['p_spark']:.3f}" for r in runs)
    late = [_mean(r["reward"][-max(len(r["reward"]) // 5, 1) :]) for r in runs]
    heldout = [r["heldout"] for r in runs if r["heldout"] is not None]
    reg = _mean([_mean(r["reg_tokens"]) for r in runs])
    spark = [r["final"].get("success_spark") for r in runs if r["final"].get("success_spark") is not None]
    z30 = [p["z_kept_mass"] for r in runs for p in r["probe"] if p["step"] == PRECONDITION_STEP]
    return (
        f"| {condition} | {ARM_NAMES[arm]} | {len(runs)} | {counts} | {finals} | "
        f"{_mean(late):.3f} ({min(late):.3f}–{max(late):.3f}) | "
        f"{_mean(heldout):.3f} | {_mean(spark):.3f} | {reg:.1f} | {_mean(z30):.2f} |"
    )


def outcome(run: dict[str, Any]) -> str:
    """The fate, coarse: lost (extinguished or declining), kept, or taken over."""
    return {"extinguished": "lost", "declining": "lost"}.get(fate(run), fate(run))


def verdicts(by: dict[tuple[str, str], list[dict[str, Any]]]) -> list[str]:
    """The pre-registered hypotheses, each held, refuted or not yet testable (seeds missing)."""

    def count(condition: str, arm: str, wanted: tuple[str, ...]) -> tuple[int, int]:
        runs = by.get((condition, arm), [])
        return sum(outcome(r) in wanted for r in runs), len(runs)

    def paired(condition: str, arm: str, other: str) -> tuple[int, int]:
        mine = {r["seed"]: outcome(r) for r in by.get((condition, arm), [])}
        theirs = {r["seed"]: outcome(r) for r in by.get((condition, other), [])}
        seeds = mine.keys() & theirs.keys()
        return sum(mine[s] == theirs[s] for s in seeds), len(seeds)

    checks = [
        ("H1", "with the tail, GRPO loses the spark", count("tail", "grpo", ("lost",)), 3),
        ("H1", "with the tail, Lp-Reg β = 0 loses it", count("tail", "lpreg-b0", ("lost",)), 3),
        ("H2", "with the tail, Lp-Reg β = 1 keeps it", count("tail", "lpreg", ("kept", "taken over")), 3),
        ("H2", "… and its path takes over", count("tail", "lpreg", ("taken over",)), 2),
        ("H3", "without the tail, Lp-Reg β = 1 ends as β = 0", paired("plain", "lpreg", "lpreg-b0"), 3),
        ("H4", "DPPO ends as GRPO, with the tail", paired("tail", "dppo", "grpo"), 3),
        ("H4", "… and without", paired("plain", "dppo", "grpo"), 3),
    ]  # fmt: skip
    lines = []
    for name, what, (hit, n), need in checks:
        state = "not yet testable" if n < 4 else ("held" if hit >= need else "refuted")
        lines.append(
            f"- {name}: {what} (≥ {need} of 4 seeds): {hit} of {n} — **{state}** (forecast: {FORECAST[name]})"
        )
    return lines


def figure(by: dict[tuple[str, str], list[dict[str, Any]]], out: Path, key: str) -> Path:
    conditions = sorted({c for c, _ in by})
    fig, axes = plt.subplots(
        1, max(len(conditions), 1), figsize=(6 * max(len(conditions), 1), 4), squeeze=False
    )
    for ax, condition in zip(axes[0], conditions, strict=False):
        for index, arm in enumerate(ARM_NAMES):
            for seed_index, run in enumerate(by.get((condition, arm), [])):
                if key == "p_spark":
                    xs, ys = [p["step"] for p in run["probe"]], [p["p_spark"] for p in run["probe"]]
                else:
                    xs, ys = list(range(1, len(run["reward"]) + 1)), _smooth(run["reward"], 10)
                label = ARM_NAMES[arm] if seed_index == 0 else None
                ax.plot(xs, ys, color=f"C{index}", alpha=0.7, linewidth=1, label=label)
        ax.set_title(
            f"{condition}: {'p(spark) at the fork' if key == 'p_spark' else 'reward (10-step mean)'}"
        )
        ax.set_xlabel("step")
        if key == "p_spark":
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    path = out / f"fork_{key}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.4f}" if high - low < 5e-5 else f"{low:.4f}–{high:.4f}"


def _smooth(values: list[float], width: int) -> list[float]:
    return [_mean(values[max(0, i - width + 1) : i + 1]) for i in range(len(values))]


# What we forecast for each hypothesis, written in the pre-registration before the first registered run.
FORECAST = {
    "H1": "holds at most marginally",
    "H2": "refuted",
    "H3": "holds",
    "H4": "holds",
}


def divergence(by: dict[tuple[str, str], list[dict[str, Any]]]) -> list[str]:
    """Per condition and arm, per seed: the first step whose reward differs from the same seed's GRPO run
    (paired runs share prompts, sampling seeds and learner seed, so they are one run until a sampled token
    differs); and DPPO's masked tokens over each run."""
    lines = []
    for condition in ("tail", "plain"):
        grpo = {r["seed"]: r["reward"] for r in by.get((condition, "grpo"), [])}
        for arm in [a for a in ARM_NAMES if a != "grpo"]:
            firsts = []
            for run in sorted(by.get((condition, arm), []), key=lambda r: r["seed"]):
                theirs = grpo.get(run["seed"])
                if theirs is None:
                    continue
                step = next(
                    (i + 1 for i, (a, b) in enumerate(zip(run["reward"], theirs, strict=False)) if a != b),
                    None,
                )
                firsts.append(f"s{run['seed']} {step if step is not None else 'never'}")
            if firsts:
                lines.append(f"{condition}, {ARM_NAMES[arm]}: " + ", ".join(firsts))
    masked = [
        f"{r['condition']} s{r['seed']} {sum(r['masked']):.0f} of {sum(r['tokens']):,.0f}"
        for r in sorted(
            by.get(("tail", "dppo"), []) + by.get(("plain", "dppo"), []),
            key=lambda r: (r["condition"], r["seed"]),
        )
    ]
    return [
        "Paired runs leave GRPO's trajectory (the first step whose reward differs from the same seed's "
        "GRPO run): " + "; ".join(lines) + ".",
        "",
        "Tokens DPPO's mask acted on, over each whole run, of the tokens it trained: "
        + ", ".join(masked)
        + ".",
    ]


def write_report(records: Path, out: Path, names: list[str], steps: int) -> dict[str, Any]:
    """The section between the markers of out/report.md (the rest kept) and the figures."""
    runs = [read(records / n) for n in names if recorded_steps(records / n) is not None]
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        by.setdefault((run["condition"], run["arm"]), []).append(run)
    head = f"{len(runs)} of {len(names)} runs recorded ({steps} steps each)" + (
        "" if len(runs) == len(names) else ": the verdict is preliminary"
    )
    table = [
        "| condition | arm | seeds | fate of the spark | final p(spark) per seed "
        "| reward, last fifth (range) | held-out pass@1 | spark path success, final "
        f"| regularized tokens a step | Z at step {PRECONDITION_STEP} |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(arm_line(c, a, by.get((c, a), [])) for c in ("tail", "plain") for a in ARM_NAMES),
    ]
    starts = [
        f"{c}: p(spark) {_span([r['start']['p_spark'] for r in runs if r['condition'] == c])}, "
        f"Z {_span([r['start']['z_kept_mass'] for r in runs if r['condition'] == c])}"
        for c in ("tail", "plain")
        if any(r["condition"] == c for r in runs)
    ]
    out.mkdir(parents=True, exist_ok=True)
    figures = [figure(by, out, "p_spark"), figure(by, out, "reward")] if runs else []
    section = [
        BEGIN,
        "### Results (written by bench/fork_report.py from the records)",
        "",
        head + ".",
        "",
        "Start state at step 0, over the runs (one start model per condition: a spread means a rebuilt one "
        "differs): " + "; ".join(starts) + ".",
        "",
        *table,
        "",
        *verdicts(by),
        "",
        *divergence(by),
        "",
        *(f"![{f.stem}]({f.name})" for f in figures),
        END,
    ]
    report = out / "report.md"
    text = report.read_text() if report.is_file() else ""
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + "\n".join(section) + text[text.index(END) + len(END) :]
    else:
        text = text + ("\n" if text else "") + "\n".join(section) + "\n"
    report.write_text(text)
    return {"report": str(report), "recorded": len(runs), "planned": len(names)}
