"""Lp-Reg's dose response in the wide report: the ρ sweep's line in the verdict, its table rows and its
plot. The sweep is one seed: it reports each ρ's numbers and claims no ordering of them (issue 47: a
ranking by ρ rested on one seed and on an entropy measure that an early effect inverted)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from learning_quality import _save
from lq_verdict import LABELS

if TYPE_CHECKING:
    from learning_quality_wide import Spec


def dose_line(
    stats: dict[str, dict[str, float]], dose: list[tuple[float, Spec]], losses: tuple[str, ...], first: int
) -> str:
    """What the ρ sweep (one seed) adds to the verdict: pass@1 and entropy kept per ρ, and how its best
    point compares with the baselines on the same seed."""
    if len(dose) < 2:
        return ""
    rhos = ", ".join(f"{rho:.0%}" for rho, _ in dose)
    passes = ", ".join(f"{stats[spec.name]['pass@1']:.3f}" for _, spec in dose)
    kept = ", ".join(f"{stats[spec.name]['entropy_kept']:.2f}" for _, spec in dose)
    rho, spec = max(dose, key=lambda point: stats[point[1].name]["pass@1"])
    best = stats[spec.name]["pass@1"]
    same_seed = {
        loss: stats[f"{loss}-s{first}"]["pass@1"]
        for loss in losses
        if loss != "lp_reg" and f"{loss}-s{first}" in stats
    }
    others = ", ".join(f"{LABELS.get(loss, loss)} {value:.3f}" for loss, value in same_seed.items())
    above = bool(same_seed) and all(best > value for value in same_seed.values())
    if above:
        where = (
            f"above every baseline on the same seed ({others}); one seed per ρ, so a second seed at that ρ "
            "is what would make it a result rather than a lead"
        )
    else:
        where = f"not above every baseline on the same seed ({others}): no ρ tried lifts Lp-Reg past them"
    mid = ", ".join(f"{stats[spec.name].get('entropy_mid', float('nan')):.3f}" for _, spec in dose)
    regs = ", ".join(f"{stats[spec.name]['reg_tokens']:.1f}" for _, spec in dose)
    return (
        f" Across ρ = {rhos} (seed {first} only), Lp-Reg regularized {regs} tokens a step; its pass@1 was "
        f"{passes}; entropy kept {kept}, and mean entropy over steps 31–150 {mid}. Its best, ρ = {rho:.0%} "
        f"at {best:.3f}, is {where}. One seed per ρ orders nothing: how entropy moves with ρ is not a "
        "finding here."
    )


def dose_rows(stats: dict[str, dict[str, float]], dose: list[tuple[float, Spec]], n: int) -> list[str]:
    head = (
        "| ρ | k per micro-batch (mean) | regularized tokens / step | entropy step 1 → final | entropy kept |"
    )
    lines = [head + f" entropy, steps 31–150 | low-prob share | pass@1 | pass@{n} |", "|---" * 9 + "|"]
    for rho, spec in dose:
        v = stats[spec.name]
        lines.append(
            f"| {rho:.0%} (`{spec.name}`) | {v['k_mean']:.1f} | {v['reg_tokens']:.1f} | "
            f"{v['entropy_step1']:.3f} → {v['entropy_final']:.3f} | {v['entropy_kept']:.2f} | "
            f"{v['entropy_mid']:.3f} | {v['low_prob_share']:.3f} | {v['pass@1']:.3f} | {v[f'pass@{n}']:.3f} |"
        )
    return lines


def dose_plot(
    stats: dict[str, dict[str, float]], dose: list[tuple[float, Spec]], baselines: list[str], out: Path
) -> str:
    """Regularized tokens per step against the entropy kept and against held-out pass@1, each point a ρ;
    `baselines`: the other losses' runs on the same seed, drawn as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    xs = [stats[s.name]["reg_tokens"] for _, s in dose]
    for ax, measure, label in zip(
        axes, ("entropy_kept", "pass@1"), ("entropy kept (final / step 1)", "held-out pass@1"), strict=True
    ):
        ys = [stats[s.name][measure] for _, s in dose]
        ax.plot(xs, ys, "o-", color="tab:red", label="Lp-Reg")
        for (rho, _), x, y in zip(dose, xs, ys, strict=True):
            ax.annotate(f"ρ = {rho:.0%}", (x, y), textcoords="offset points", xytext=(5, 5))
        for name, style in zip(baselines, ("--", ":", "-."), strict=False):
            said = f"{LABELS.get(name.split('-s')[0], name)}, same seed"
            ax.axhline(stats[name][measure], color="gray", ls=style, label=said)
        ax.set(xlabel="regularized tokens per step", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Lp-Reg's dose response (one seed)")
    return _save(fig, out / "wide_dose.png")
