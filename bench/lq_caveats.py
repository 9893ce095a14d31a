"""What the learning-quality records say against over-reading them (issue 47): the paired test a
difference must pass, how asynchronous the runs were, and how far the regularizer reached.

- `paired_p`: the two-sided paired t-test of Lp-Reg against a baseline, seed by seed (each seed feeds
  every loss the same prompt stream). With 2 seeds, df = 1: a difference needs |t| > 12.7 for p < 0.05.
- `async_line`: the share of trained tokens sampled by the learner's current version
  (`rollout/token_lag_0_share`) over the first 60 steps, and `learner.max_staleness`: the paper's lead
  for Lp-Reg is on-policy.
- `reach_line`: Lp-Reg's regularized tokens a step against the tokens trained, the steps where it touched
  none, and its kl3 at step 1 (the one fresh step), which bounds its on-policy pull, β(1/Z − 1).
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from learning_quality import Run  # which imports this module (through lq_verdict)

ALPHA = 0.05  # a difference counts only where the paired test's p is below this
EARLY_STEPS = 60  # the window of `async_line`


def _series(run: Run, name: str) -> np.ndarray:
    """A step-row metric over the run's steps (NaN where a row lacks it)."""
    return np.array([np.nan if row.get(name) is None else row[name] for row in run.steps], dtype=float)


def _t_pdf(x: float, df: int) -> float:
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(c - (df + 1) / 2 * math.log1p(x * x / df))


def paired_p(diffs: tuple[float, ...] | list[float]) -> float:
    """Two-sided p of the paired t-test that the mean of `diffs` is 0 (1.0 with fewer than 2 or no spread:
    no evidence). The t CDF by Simpson's rule over [0, |t|] (4000 intervals: p to ~1e-6 for df ≥ 1)."""
    n = len(diffs)
    if n < 2:
        return 1.0
    sd = statistics.stdev(diffs)
    mean = statistics.fmean(diffs)
    if sd == 0:
        return 0.0 if mean != 0 else 1.0
    t, df = abs(mean / (sd / math.sqrt(n))), n - 1
    steps = 4000
    xs = np.linspace(0.0, t, steps + 1)
    ys = np.array([_t_pdf(float(x), df) for x in xs])
    area = (t / steps / 3) * (ys[0] + ys[-1] + 4 * ys[1:-1:2].sum() + 2 * ys[2:-1:2].sum())
    return float(min(1.0, max(0.0, 1.0 - 2.0 * area)))


def async_line(runs: dict[str, Run], max_staleness: int | None) -> str:
    """How on-policy the runs were: the current version's share of the trained tokens, steps 1–60."""
    shares = {
        name: float(np.nanmean(_series(run, "rollout/token_lag_0_share")[:EARLY_STEPS]))
        for name, run in runs.items()
    }
    shares = {name: share for name, share in shares.items() if not math.isnan(share)}
    if not shares:
        return ""
    low, high = min(shares.values()), max(shares.values())
    bound = f"`learner.max_staleness: {max_staleness}`" if max_staleness is not None else "a staleness bound"
    return (
        f" **The runs were asynchronous** ({bound}): in steps 1–{EARLY_STEPS} only {low:.0%}–{high:.0%} of "
        "the trained tokens were sampled by the learner's current version (`rollout/token_lag_0_share`, mean "
        "by run), the rest by older ones. The paper's lead for Lp-Reg is on-policy; off-policy it trails "
        "KL-Cov and 80/20 in its own table, so these runs do not test its headline setting."
    )


def reach_line(runs: dict[str, Run]) -> str:
    """How much Lp-Reg's regularizer acted, over its runs at the preset's ρ: tokens a step, steps with
    none, and its kl3 at step 1."""
    if not runs:
        return ""
    per_step = [float(np.nanmean(np.nan_to_num(_series(r, "loss/reg_tokens")))) for r in runs.values()]
    trained = [float(np.nanmean(_series(r, "rollout/tokens"))) for r in runs.values()]
    idle = [int((np.nan_to_num(_series(r, "loss/reg_tokens")) == 0).sum()) for r in runs.values()]
    first_kl3 = [float(_series(r, "loss/kl3_mean")[0]) for r in runs.values()]
    steps = len(next(iter(runs.values())).steps)
    said = " and ".join(f"{x:.1f}" for x in per_step)
    return (
        f" **The regularizer barely acted**: it touched {said} tokens a step (`loss/reg_tokens`, by run) of "
        f"≈ {statistics.fmean(trained):,.0f} trained, and none at all in {' and '.join(map(str, idle))} of "
        f"{steps} steps; at step 1, the one fresh step, its kl3 was "
        f"{' and '.join(f'{x:.4f}' for x in first_kl3)} (on-policy its pull on a kept token is β(1/Z − 1), "
        "Z the mass min-p keeps)."
    )
