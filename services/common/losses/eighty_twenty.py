"""Beyond the 80/20 rule (Wang et al. 2025): policy gradient on the high-entropy forking tokens only.

Source read: the Lp-Reg authors' fork CarlanLark/Lp-Reg-dev, `verl/trainer/ppo/core_algos.py`
(`compute_policy_loss_8020_split`). The selection is tensorized with deterministic ties (flat position).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from sparkrl.services.common.losses.ops import (
    Metrics,
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
from sparkrl.services.common.losses.section import CLIP_HIGH, CLIP_LOW, LossSection

if TYPE_CHECKING:
    from torch import Tensor


class EightyTwentyLoss(LossSection):
    """80/20: only the highest-entropy tokens get policy gradient."""

    name: Literal["eighty_twenty"] = "eighty_twenty"
    top_frac: float = Field(
        0.2,
        gt=0,
        le=1,
        description="Fraction of valid tokens (highest entropy) trained.",
        json_schema_extra={"why": {"gt": "0 trains no token at all", "le": "it is a fraction of the tokens"}},
    )
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.", json_schema_extra=CLIP_LOW)
    clip_high: float = Field(0.28, ge=0, le=100, description="ε_high.", json_schema_extra=CLIP_HIGH)


# Its mean is over the chosen tokens only: an aggregation's weights would not apply.
@register_loss(EightyTwentyLoss, own_aggregation=True)
def eighty_twenty_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: EightyTwentyLoss,
    *,
    entropy: Tensor,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """S    = the max(1, int(N_valid · top_frac)) valid tokens with the highest entropy (detached choice)
        loss = Σ_{t∈S} clip_higher_t / |S|

    The mean over S only, as in the Lp-Reg fork (`compute_policy_loss_8020_split` shrinks the mask).
    """
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    loss_t, clipped = clipped_surrogate(ratio, adv, cfg.clip_low, cfg.clip_high)
    n_top = count_fraction(valid.sum(), cfg.top_frac, at_least_one=True)
    top = select_lowest(-entropy.detach().float(), valid, n_top)
    loss = masked_mean(weighted(loss_t, token_weights, valid), top)
    metrics = ratio_metrics(log_ratio, ratio, clipped, valid)
    with torch.no_grad():
        metrics["clip_frac"] = masked_mean(clipped.to(ratio.dtype), top)  # among trained tokens, as verl
        metrics["trained_frac"] = masked_mean(top.to(ratio.dtype), valid)
    return loss, metrics
