"""Clip-Cov (Cui et al. 2025), verl's definition: detach a random few tokens whose covariance between
log-prob and advantage lies in a band.

Source read: verl `verl/trainer/ppo/core_algos.py` (`compute_policy_loss_clip_cov`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from sparkrl.services.common.losses.ops import (
    Metrics,
    centered_cov,
    clipped_surrogate,
    count_fraction,
    masked_mean,
    prepare,
    ratio_metrics,
    select_lowest,
    torch,
    weighted,
)
from sparkrl.services.common.losses.registry import register_loss
from sparkrl.services.common.losses.section import CLIP_HIGH, CLIP_LOW, FRACTION, LossSection

if TYPE_CHECKING:
    from torch import Generator, Tensor

# A token's covariance term (logp − mean)·(A − mean) stays within a few hundred for any real policy.
COV_LIMIT = 1000.0
COVARIANCE = {
    "why": {
        "ge": "a token's covariance term stays well inside ±1000",
        "le": "a token's covariance term stays well inside ±1000",
    }
}


class ClipCovLoss(LossSection):
    """Clip-Cov: detach a random few tokens whose covariance lies in [lb, ub]."""

    name: Literal["clip_cov"] = "clip_cov"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.", json_schema_extra=CLIP_LOW)
    clip_high: float = Field(0.2, ge=0, le=100, description="ε_high.", json_schema_extra=CLIP_HIGH)
    clip_cov_ratio: float = Field(
        2e-4, ge=0, le=1, description="Fraction of tokens detached.", json_schema_extra=FRACTION
    )
    clip_cov_lb: float = Field(
        1.0, ge=-COV_LIMIT, le=COV_LIMIT, description="Lower covariance bound.", json_schema_extra=COVARIANCE
    )
    clip_cov_ub: float = Field(
        5.0, ge=-COV_LIMIT, le=COV_LIMIT, description="Upper covariance bound.", json_schema_extra=COVARIANCE
    )


@register_loss(ClipCovLoss)
def clip_cov_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: ClipCovLoss,
    *,
    token_weights: Tensor | None = None,
    generator: Generator | None = None,
) -> tuple[Tensor, Metrics]:
    """cov_t  = (A_t − mean A)·(logp_t − mean logp)          means over valid tokens, detached
        C      = valid tokens not already PPO-clipped with lb < cov_t < ub
        S      = min(max(1, int(N_valid · clip_cov_ratio)), |C|) tokens drawn uniformly from C
        loss_t = 0 for t ∈ S (no gradient);   max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)) otherwise
        loss   = token-mean (S still counts in the denominator, as in verl)

    The draw uses `generator` (uniform keys, k smallest) so runs are reproducible; the learner leaves it
    to torch's seeded default (`learner.seed`). ε defaults to verl's `clip_ratio` 0.2; Cui et al.'s recipe
    ran with clip_ratio_low = clip_ratio_high = 1 — set them. `clip_frac` is the PPO-clip fraction;
    `cov_clip_frac` is |S| / N_valid (verl's "pg_clipfrac").
    """
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    ppo_t, clipped = clipped_surrogate(ratio, adv, cfg.clip_low, cfg.clip_high)
    cov = centered_cov(adv, logp, valid)
    candidates = valid & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    n_clip = count_fraction(valid.sum(), cfg.clip_cov_ratio, at_least_one=True)
    draw = torch.rand(cov.shape, generator=generator, device=cov.device)
    detached = select_lowest(draw, candidates, n_clip)
    loss_t = torch.where(detached, torch.zeros_like(ppo_t), ppo_t)
    loss = masked_mean(weighted(loss_t, token_weights, valid), valid)
    metrics = ratio_metrics(log_ratio, ratio, clipped, valid)
    metrics["cov_clip_frac"] = masked_mean(detached.to(ratio.dtype), valid)
    return loss, metrics
