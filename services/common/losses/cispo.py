"""CISPO: clipped importance-sampling-weight policy optimization (MiniMax-M1, Chen et al. 2025, arXiv
2506.13585, Eqs. 4-5). Where PPO's clip drops a token's gradient once its ratio leaves the range — the
rare, high-ratio tokens ("However", "Wait") among the first — CISPO clips only the weight and keeps every
token's REINFORCE gradient:

    J(θ) = E[ 1 / Σ_i |o_i| · Σ_i Σ_t sg(r̂_{i,t}(θ)) · Â_{i,t} · log π_θ(o_{i,t} | q, o_{i,<t}) ]     (4)
    r̂_{i,t}(θ) = clip(r_{i,t}(θ), 1 − ε_low, 1 + ε_high)                                          (5)

The paper sets ε_low large (no lower bound) and tunes ε_high only; the defaults here, ε_low = 1 (the
weight bounded below by 0 only) and ε_high = 4, are torchtitan's RL recipe's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from sparkrl.services.common.losses.ops import Metrics, masked_mean, prepare, ratio_metrics, torch, weighted
from sparkrl.services.common.losses.registry import register_loss
from sparkrl.services.common.losses.section import CLIP_HIGH, CLIP_LOW, LossSection

if TYPE_CHECKING:
    from torch import Tensor


class CispoLoss(LossSection):
    """CISPO (MiniMax-M1): REINFORCE on every token, weighted by the clipped, detached IS ratio."""

    name: Literal["cispo"] = "cispo"
    clip_low: float = Field(
        1.0,
        ge=0,
        le=1,
        description="ε_low: the weight clipped below at 1 − ε_low.",
        json_schema_extra=CLIP_LOW,
    )
    clip_high: float = Field(
        4.0,
        ge=0,
        le=100,
        description="ε_high: the weight clipped above at 1 + ε_high.",
        json_schema_extra=CLIP_HIGH,
    )


@register_loss(CispoLoss, zero_advantage_free=True)
def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: CispoLoss,
    *,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """loss_t = −sg(clip(r, 1 − ε_low, 1 + ε_high)) · A · logp,   r = exp(logp − old_logp);  token-mean.

    `clip_frac` counts the tokens whose weight was clipped (their gradient is kept, only scaled)."""
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    weight = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high).detach()
    logp_c = torch.where(valid, logp.to(ratio.dtype), torch.zeros_like(ratio))  # padding's −inf kept out
    loss_t = -weight * adv * logp_c
    loss = masked_mean(weighted(loss_t, token_weights, valid), valid)
    clipped = (ratio < 1.0 - cfg.clip_low) | (ratio > 1.0 + cfg.clip_high)
    return loss, ratio_metrics(log_ratio, ratio, clipped, valid)
