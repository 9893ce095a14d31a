"""Clip-Higher (DAPO, Yu et al. 2025): PPO-clip with an asymmetric range, ε_low = 0.2, ε_high = 0.28.

Source read for the definition and defaults: verl `verl/trainer/ppo/core_algos.py` (`compute_policy_loss`
with `clip_ratio_low` / `clip_ratio_high`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from sparkrl.services.common.losses.ops import Metrics
from sparkrl.services.common.losses.ppo_clip import PpoClipLoss, ppo_clip_loss
from sparkrl.services.common.losses.registry import register_loss
from sparkrl.services.common.losses.section import CLIP_HIGH, CLIP_LOW, LossSection

if TYPE_CHECKING:
    from torch import Tensor


class ClipHigherLoss(LossSection):
    """DAPO's Clip-Higher: asymmetric clip."""

    name: Literal["clip_higher"] = "clip_higher"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.", json_schema_extra=CLIP_LOW)
    clip_high: float = Field(0.28, ge=0, le=100, description="ε_high.", json_schema_extra=CLIP_HIGH)


@register_loss(ClipHigherLoss, zero_advantage_free=True)
def clip_higher_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: ClipHigherLoss,
    *,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)), token-mean: PPO-clip at Clip-Higher's range."""
    clip = PpoClipLoss(clip_low=cfg.clip_low, clip_high=cfg.clip_high)
    return ppo_clip_loss(logp, old_logp, advantages, mask, clip, token_weights=token_weights)
