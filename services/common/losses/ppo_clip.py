"""PPO-clip / GRPO: the clipped surrogate every ratio-based loss starts from.

Sources read for the definition and defaults: verl `verl/trainer/ppo/core_algos.py` and its
`ppo_trainer.yaml`; the Lp-Reg authors' fork CarlanLark/Lp-Reg-dev (same file). Selections are tensorized
with deterministic ties (flat position), where verl's `topk` breaks ties arbitrarily.
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
    weighted,
)
from sparkrl.services.common.losses.registry import register_loss
from sparkrl.services.common.losses.section import CLIP_HIGH, CLIP_LOW, LossSection

if TYPE_CHECKING:
    from torch import Tensor


class PpoClipLoss(LossSection):
    """PPO/GRPO clipped surrogate."""

    name: Literal["ppo_clip", "grpo"] = "ppo_clip"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.", json_schema_extra=CLIP_LOW)
    clip_high: float = Field(0.2, ge=0, le=100, description="ε_high.", json_schema_extra=CLIP_HIGH)


@register_loss(PpoClipLoss, zero_advantage_free=True)
def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PpoClipLoss,
    *,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """PPO-clip / GRPO (Schulman et al. 2017; Shao et al. 2024), token-mean:

        loss = mean_valid max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)),   r = exp(logp − old_logp)

    No dual-clip: the Lp-Reg authors' fork has verl's dual-clip (clip_ratio_c) commented out.
    """
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    loss_t, clipped = clipped_surrogate(ratio, adv, cfg.clip_low, cfg.clip_high)
    loss = masked_mean(weighted(loss_t, token_weights, valid), valid)
    return loss, ratio_metrics(log_ratio, ratio, clipped, valid)
