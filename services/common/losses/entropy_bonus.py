"""GRPO + entropy loss: the clipped surrogate minus c times the current policy's entropy.

Source read for the definition and default: verl `verl/workers/actor/dp_actor.py` (`entropy_coeff`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from sparkrl.services.common.losses.ops import (
    Metrics,
    clipped_surrogate,
    masked_mean,
    prepare,
    ratio_metrics,
    torch,
    weighted,
)
from sparkrl.services.common.losses.registry import register_loss
from sparkrl.services.common.losses.section import CLIP_HIGH, CLIP_LOW, LossSection

if TYPE_CHECKING:
    from torch import Tensor


class EntropyBonusLoss(LossSection):
    """GRPO + entropy loss."""

    name: Literal["entropy_bonus"] = "entropy_bonus"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.", json_schema_extra=CLIP_LOW)
    clip_high: float = Field(0.2, ge=0, le=100, description="ε_high.", json_schema_extra=CLIP_HIGH)
    entropy_coef: float = Field(
        0.001,
        ge=0,
        le=1,
        description="Weight of −entropy in the loss.",
        json_schema_extra={
            "why": {
                "ge": "a negative weight would push the entropy down, toward the collapse Lp-Reg prevents",
                "le": "a larger weight makes maximal entropy the objective: the policy goes uniform",
            }
        },
    )


@register_loss(EntropyBonusLoss, entropy_gradient=True)
def entropy_bonus_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: EntropyBonusLoss,
    *,
    entropy: Tensor,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """GRPO + entropy loss: loss = mean_valid [ppo_clip_t − c·H_t], H_t the current policy's entropy.

    c = 0.001 is verl's historical `actor.entropy_coeff` default (the Lp-Reg fork's yaml sets 0, i.e. the
    bonus off, for its own runs). `entropy` must carry gradient for the bonus to act.
    """
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    ppo_t, clipped = clipped_surrogate(ratio, adv, cfg.clip_low, cfg.clip_high)
    entropy_c = torch.where(valid, entropy.to(ratio.dtype), torch.zeros_like(ratio))
    loss_t = ppo_t - cfg.entropy_coef * entropy_c
    loss = masked_mean(weighted(loss_t, token_weights, valid), valid)
    metrics = ratio_metrics(log_ratio, ratio, clipped, valid)
    metrics["entropy"] = masked_mean(entropy_c.detach(), valid)
    return loss, metrics
