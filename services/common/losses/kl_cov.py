"""KL-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"), verl's definition: a KL
penalty on the few tokens of highest covariance between log-prob and advantage.

Source read: verl `verl/trainer/ppo/core_algos.py` (`compute_policy_loss_kl_cov`). The selection is
tensorized with deterministic ties (flat position), where verl's `topk` breaks them arbitrarily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from sparkrl.services.common.losses.ops import (
    Metrics,
    centered_cov,
    count_fraction,
    masked_mean,
    prepare,
    ratio_metrics,
    select_lowest,
    torch,
    weighted,
)
from sparkrl.services.common.losses.registry import register_loss
from sparkrl.services.common.losses.section import FRACTION, WEIGHT, LossSection

if TYPE_CHECKING:
    from torch import Tensor


class KlCovLoss(LossSection):
    """KL-Cov: a KL penalty on the tokens of highest covariance between logp and advantage."""

    name: Literal["kl_cov"] = "kl_cov"
    kl_cov_ratio: float = Field(
        2e-4, ge=0, le=1, description="Fraction of tokens penalized.", json_schema_extra=FRACTION
    )
    ppo_kl_coef: float = Field(
        1.0, ge=0, le=100, description="Weight of |logp − old_logp| on them.", json_schema_extra=WEIGHT
    )


@register_loss(KlCovLoss)
def kl_cov_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: KlCovLoss,
    *,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """cov_t  = (A_t − mean A)·(logp_t − mean logp)          means over valid tokens, detached
        S      = the max(1, int(N_valid · kl_cov_ratio)) valid tokens with the largest cov_t
        loss_t = −A·r + c·|logp − old_logp|   for t ∈ S;   −A·r otherwise   (no ratio clip at all)
        loss   = token-mean

    `clip_frac` is 0 (nothing is clipped); `reg_frac` is |S| / N_valid; `kl_abs` is mean |log r|.
    """
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    n_reg = count_fraction(valid.sum(), cfg.kl_cov_ratio, at_least_one=True)
    selected = select_lowest(-centered_cov(adv, logp, valid), valid, n_reg)
    pg_t = -adv * ratio
    loss_t = torch.where(selected, pg_t + cfg.ppo_kl_coef * log_ratio.abs(), pg_t)
    loss = masked_mean(weighted(loss_t, token_weights, valid), valid)
    metrics = ratio_metrics(log_ratio, ratio, torch.zeros_like(valid), valid)
    with torch.no_grad():
        metrics["reg_frac"] = masked_mean(selected.to(ratio.dtype), valid)
        metrics["kl_abs"] = masked_mean(log_ratio.abs(), valid)
    return loss, metrics
