"""bench/lq_verdict.py: the wide verdict names one of the issue's outcomes (an effect, none, or one on
entropy without one on accuracy) only where the difference beats the seed spread on every seed."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from lq_verdict import compare, outcome_line, verdict  # noqa: E402

LOSSES = ("lp_reg", "grpo", "kl_cov")


def stats(**by_loss: tuple[tuple[float, float], tuple[float, float]]) -> dict[str, dict[str, float]]:
    """Per-run numbers from {loss: ((pass@1 s1, s2), (entropy kept s1, s2))}."""
    return {
        f"{loss}-s{seed}": {"pass@1": passes[i], "entropy_kept": kept[i]}
        for loss, (passes, kept) in by_loss.items()
        for i, seed in enumerate((1, 2))
    }


def test_more_entropy_kept_on_every_seed_without_more_accuracy_is_an_effect_on_entropy_alone() -> None:
    line = outcome_line(
        stats(
            lp_reg=((0.44, 0.45), (0.30, 0.32)),
            grpo=((0.44, 0.46), (0.12, 0.13)),
            kl_cov=((0.43, 0.44), (0.16, 0.15)),
        ),
        LOSSES,
        (1, 2),
    )
    assert "**What the data says, over 2 seeds: an effect on entropy without one on accuracy.**" in line
    assert "Held-out pass@1 0.445 ± 0.007 against GRPO's 0.450 ± 0.014" in line  # best baseline by mean
    assert "entropy kept 0.310 ± 0.014 against KL-Cov's 0.155 ± 0.007 (difference +0.155" in line
    assert "seed by seed +0.140, +0.170)" in line


def test_both_measures_above_the_spread_is_an_effect() -> None:
    line = outcome_line(
        stats(lp_reg=((0.50, 0.52), (0.30, 0.31)), grpo=((0.44, 0.45), (0.12, 0.13))), LOSSES[:2], (1, 2)
    )
    assert "an effect: Lp-Reg keeps more entropy and is more accurate than the best baseline" in line


def test_a_difference_within_the_spread_or_of_mixed_sign_is_no_effect() -> None:
    within = stats(lp_reg=((0.40, 0.50), (0.10, 0.20)), grpo=((0.44, 0.46), (0.12, 0.16)))
    assert "2 seeds: no effect: Lp-Reg neither" in outcome_line(within, LOSSES[:2], (1, 2))
    # a mean difference larger than both spreads, yet one seed goes the other way: not an effect
    mixed = stats(lp_reg=((0.30, 0.40), (0.10, 0.10)), grpo=((0.32, 0.22), (0.10, 0.10)))
    accuracy = compare(mixed, LOSSES[:2], (1, 2), "pass@1")
    assert abs(accuracy.difference) > accuracy.spread and accuracy.paired[0] < 0 < accuracy.paired[1]
    assert accuracy.sign == 0


def test_less_accurate_by_more_than_the_spread_is_said() -> None:
    line = outcome_line(
        stats(lp_reg=((0.40, 0.41), (0.12, 0.13)), kl_cov=((0.47, 0.48), (0.15, 0.16))),
        ("lp_reg", "kl_cov"),
        (1, 2),
    )
    assert "no effect in Lp-Reg's favour: it keeps no more entropy and is *less* accurate" in line


def test_one_seed_names_no_outcome_and_no_lp_reg_no_sentence() -> None:
    one = stats(lp_reg=((0.4, 0.4), (0.3, 0.3)), grpo=((0.3, 0.3), (0.1, 0.1)))
    assert "waits for a second seed's spread" in outcome_line(one, LOSSES[:2], (1,))
    assert outcome_line(one, ("grpo",), (1, 2)) == ""


def test_the_verdicts_entropy_sentence_names_only_the_losses_compared() -> None:
    entropy = {"entropy_first": 0.5, "reg_tokens": 3.0, "tokens": 9.0}
    runs = {
        "lp_reg-s1": {"pass@1": 0.4, "entropy_final": 0.1} | entropy,
        "kl_cov-s1": {"pass@1": 0.5, "entropy_final": 0.05} | entropy,
    }
    said = verdict(runs, ("lp_reg", "kl_cov"), (1,))  # no GRPO run in (seed 1's moved aside, say)
    assert "Entropy, last tenth of the run over the first: Lp-Reg 0.20; KL-Cov 0.10." in said
    assert "nan" not in said and "GRPO" not in said
