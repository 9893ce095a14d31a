"""What the learning-quality reports conclude, in words: the verdict's sentences and how each loss is named.

`verdict` (every report): does Lp-Reg beat the best baseline's held-out pass@1 by more than the seed
spread, and how much entropy each loss kept. `outcome_line` (the wide report's lead): which of the wide
issue's outcomes the records show (an effect, no effect, or an effect on entropy without one on
accuracy), with the spread it rests on.

The outcome weighs two measures, each Lp-Reg against the best baseline on that measure, mean ± sample
std over the seeds every loss has finished: held-out pass@1 for accuracy, and entropy kept for
exploration (the wide report: the last tenth of a run's `loss/entropy` over its step 1, before any update
acted, so an effect early in the run cannot invert it; the first tenth, which a regularizer already
moves, was the denominator before issue 47). A difference counts as an effect only when it is larger
than the larger of the two spreads, has the same sign on every seed (each seed feeds every loss the same
prompt stream; the paired differences are printed) and passes the paired t-test at p < 0.05
(lq_caveats.paired_p)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from lq_caveats import ALPHA, paired_p

LABELS = {
    "grpo": "GRPO",
    "entropy_bonus": "GRPO + entropy bonus",
    "clip_higher": "Clip-Higher",
    "eighty_twenty": "80/20",
    "kl_cov": "KL-Cov",
    "clip_cov": "Clip-Cov",
    "lp_reg": "Lp-Reg",
}
PerRun = dict[str, dict[str, float]]  # run name → measure → value
MEASURES = {"pass@1": "held-out pass@1", "entropy_kept": "entropy kept"}


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def verdict(per_run: PerRun, losses: tuple[str, ...], seeds: tuple[int, ...]) -> str:
    """What the numbers say, plainly: does Lp-Reg beat the best baseline by more than the seed spread,
    and whose entropy collapsed."""
    if "lp_reg" not in losses or len(losses) < 2:
        return "Lp-Reg and at least one baseline are needed for a verdict."
    return f"{accuracy_sentence(per_run, losses, seeds)} {entropy_sentence(per_run, losses, seeds)}"


def accuracy_sentence(per_run: PerRun, losses: tuple[str, ...], seeds: tuple[int, ...]) -> str:
    """Lp-Reg's held-out pass@1 against the best baseline's, and whether it wins by more than the spread."""
    stats = {loss: mean_std([per_run[f"{loss}-s{s}"]["pass@1"] for s in seeds]) for loss in losses}
    best = max((loss for loss in losses if loss != "lp_reg"), key=lambda loss: stats[loss][0])
    (lp, lp_std), (bb, bb_std) = stats["lp_reg"], stats[best]
    spread = max(lp_std, bb_std)
    if lp - bb > spread:
        text = f"Lp-Reg's held-out pass@1 ({lp:.3f}) beats the best baseline, {LABELS[best]} ({bb:.3f}), by "
        return text + f"{lp - bb:.3f}, more than the seed spread ({spread:.3f})."
    text = f"Lp-Reg does **not** beat the best baseline by more than the seed spread: pass@1 {lp:.3f} ± "
    return text + f"{lp_std:.3f} against {LABELS[best]}'s {bb:.3f} ± {bb_std:.3f}."


def entropy_sentence(per_run: PerRun, losses: tuple[str, ...], seeds: tuple[int, ...]) -> str:
    """Every loss's entropy kept (last tenth over first), and the tokens Lp-Reg regularized a step."""
    drops, kept = {}, all("entropy_kept" in per_run[f"{x}-s{s}"] for x in losses for s in seeds)
    for loss in losses:
        if kept:  # the wide report's measure: the last tenth over step 1
            drops[loss] = statistics.fmean(per_run[f"{loss}-s{s}"]["entropy_kept"] for s in seeds)
            continue
        first = statistics.fmean(per_run[f"{loss}-s{s}"]["entropy_first"] for s in seeds)
        final = statistics.fmean(per_run[f"{loss}-s{s}"]["entropy_final"] for s in seeds)
        drops[loss] = final / first if first > 0 else float("nan")
    first = [loss for loss in ("grpo", "lp_reg") if loss in drops]  # GRPO and Lp-Reg, then the others
    said = ", ".join(f"{LABELS[x]} {drops[x]:.2f}" for x in first)
    said += "".join(f"; {LABELS[x]} {v:.2f}" for x, v in drops.items() if x not in first)
    reg = statistics.fmean(per_run[f"lp_reg-s{s}"]["reg_tokens"] for s in seeds)
    tokens = statistics.fmean(per_run[f"lp_reg-s{s}"]["tokens"] for s in seeds)
    measure = "the last tenth's over step 1's" if kept else "last tenth of the run over the first"
    return (
        f"Entropy kept, {measure}: {said}. Lp-Reg regularized {reg:.1f} tokens per step of the {tokens:.0f} "
        "it trained."
    )


@dataclass(frozen=True)
class Comparison:
    """Lp-Reg against the best baseline on one measure."""

    measure: str
    baseline: str
    lp: tuple[float, float]  # mean, std over seeds
    best: tuple[float, float]
    paired: tuple[float, ...]  # Lp-Reg minus the baseline, seed by seed

    @property
    def difference(self) -> float:
        return self.lp[0] - self.best[0]

    @property
    def spread(self) -> float:
        return max(self.lp[1], self.best[1])

    @property
    def p(self) -> float:
        """The paired t-test's two-sided p over the seeds."""
        return paired_p(self.paired)

    @property
    def sign(self) -> int:
        """+1 / -1 where Lp-Reg is above / below by more than the spread on every seed and the paired test
        says so (p < ALPHA), else 0."""
        if abs(self.difference) <= self.spread or self.p >= ALPHA:
            return 0
        same = all(d > 0 for d in self.paired) or all(d < 0 for d in self.paired)
        return (1 if self.difference > 0 else -1) if same else 0

    def text(self) -> str:
        paired = ", ".join(f"{d:+.3f}" for d in self.paired)
        return (
            f"{MEASURES[self.measure]} {self.lp[0]:.3f} ± {self.lp[1]:.3f} against {LABELS[self.baseline]}'s "
            f"{self.best[0]:.3f} ± {self.best[1]:.3f} (difference {self.difference:+.3f}, spread "
            f"{self.spread:.3f}; seed by seed {paired}; paired t-test p = {self.p:.2f})"
        )


def compare(stats: PerRun, losses: tuple[str, ...], seeds: tuple[int, ...], measure: str) -> Comparison:
    """Lp-Reg against the baseline with the highest mean on `measure`."""
    values = {loss: [stats[f"{loss}-s{s}"][measure] for s in seeds] for loss in losses}
    best = max((x for x in losses if x != "lp_reg"), key=lambda x: statistics.fmean(values[x]))
    paired = tuple(a - b for a, b in zip(values["lp_reg"], values[best], strict=True))
    return Comparison(measure, best, mean_std(values["lp_reg"]), mean_std(values[best]), paired)


def outcome(accuracy: Comparison, entropy: Comparison) -> str:
    """The issue's words for what the two comparisons show."""
    if accuracy.sign > 0 and entropy.sign > 0:
        return "an effect: Lp-Reg keeps more entropy and is more accurate than the best baseline"
    if accuracy.sign > 0:
        return "an effect on accuracy without one on entropy"
    if entropy.sign > 0:
        worse = " (and it is *less* accurate than the best baseline)" if accuracy.sign < 0 else ""
        return f"an effect on entropy without one on accuracy{worse}"
    if accuracy.sign < 0:
        return (
            "no effect in Lp-Reg's favour: it keeps no more entropy and is *less* accurate than the best "
            "baseline"
        )
    return (
        "no effect in Lp-Reg's favour: it is not more accurate and keeps no more entropy than the best "
        "baseline (nor is either difference against it one the paired test can tell from the seeds' spread)"
    )


def outcome_line(stats: PerRun, losses: tuple[str, ...], seeds: tuple[int, ...]) -> str:
    """The verdict's first sentence; with one seed there is no spread yet, so it names no outcome."""
    if "lp_reg" not in losses or len(losses) < 2:
        return ""
    if len(seeds) < 2:
        return (
            "Which outcome the data shows (an effect, none, or one on entropy alone) waits for a second "
            "seed's spread. "
        )
    accuracy, entropy = (compare(stats, losses, seeds, m) for m in MEASURES)
    said = accuracy.text()
    return (
        f"**What the data says, over {len(seeds)} seeds: {outcome(accuracy, entropy)}.** "
        f"{said[0].upper()}{said[1:]}; {entropy.text()}. An effect counts only where the difference is "
        "larger than the spread (the sample std over seeds, the larger of the two), has the same sign on "
        f"every seed and passes the paired t-test (p < {ALPHA}); {len(seeds)} seeds make that a high bar. "
    )
