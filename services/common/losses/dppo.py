"""DPPO with the binary total-variation trust region (Qi et al. 2026, "Rethinking the Trust Region in LLM
Reinforcement Learning", arXiv 2602.04879): PPO's ratio clip, they argue, over-penalizes low-probability
tokens (a small move in probability is a large ratio) and under-constrains high-probability ones. DPPO
masks a token's update by how far its *probability* moved from the behavior policy's instead:

    loss_t = −A_t · sg(min(r_t, C)) · M_t · log π_θ(o_t),      r_t = π_θ(o_t) / π_old(o_t)
    M_t = 0  if A_t > 0 and π_θ(o_t) − π_old(o_t) >  δ_high     (it already rose by more than δ_high)
    M_t = 0  if A_t < 0 and π_θ(o_t) − π_old(o_t) < −δ_low      (it already fell by more than δ_low)
    M_t = 1  otherwise;                                          token-mean over the valid tokens.

The gradient of a kept token is PPO's unclipped one (−A·∇r); a masked token gets none. π_old is the
policy that sampled (`learner.old_logp_source: rollout`, which the paper finds more stable than a
recomputed anchor). Source read: the paper's code (sail-sg/Stable-RL, `verl/trainer/ppo/core_algos.py`,
loss mode `dppo_binary_tv`: δ_low = δ_high = 0.2 in its launch scripts, the weight capped at C = 10).
prime-rl made it its default loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from sparkrl.services.common.losses.ops import Metrics, masked_mean, prepare, ratio_metrics, torch, weighted
from sparkrl.services.common.losses.registry import register_loss
from sparkrl.services.common.losses.section import LossSection

if TYPE_CHECKING:
    from torch import Tensor


class DppoLoss(LossSection):
    """DPPO, binary TV: PPO's surrogate gradient, each token masked once its probability left the region."""

    name: Literal["dppo"] = "dppo"
    delta_low: float = Field(
        0.2,
        gt=0,
        le=1,
        description="δ_low: a token of negative advantage is masked once its probability fell more than this "
        "below the behavior policy's (an absolute difference of probabilities).",
        json_schema_extra={
            "why": {
                "gt": "at 0 every move of a negative token would mask it: no update",
                "le": "a probability cannot fall by more than 1",
            }
        },
    )
    delta_high: float = Field(
        0.2,
        gt=0,
        le=1,
        description="δ_high: a token of positive advantage is masked once its probability rose more than "
        "this above the behavior policy's.",
        json_schema_extra={
            "why": {
                "gt": "at 0 every move of a positive token would mask it: no update",
                "le": "a probability cannot rise by more than 1",
            }
        },
    )
    max_weight: float = Field(
        10.0,
        ge=1,
        le=1000,
        description="C: the importance weight sg(r) is capped at this (Stable-RL's clip_ratio_c).",
        json_schema_extra={
            "why": {
                "ge": "below 1 the weight of an unmoved token (r = 1) would be cut",
                "le": "past it one stale token's weight outweighs a batch",
            }
        },
    )


@register_loss(DppoLoss, zero_advantage_free=True)
def dppo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: DppoLoss,
    *,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """loss_t = −A · sg(min(r, C)) · M · logp (module docstring); token-mean over the valid tokens.

    `clip_frac` is the share of valid tokens masked out of the trust region; `masked_pos_tokens` /
    `masked_neg_tokens` count those of positive and of negative advantage."""
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    old_p = torch.exp(torch.where(valid, old_logp.detach().to(ratio.dtype), torch.zeros_like(ratio)))
    moved = old_p * (ratio - 1.0)  # π − π_old, 0 on padding
    rose, fell = moved > cfg.delta_high, moved < -cfg.delta_low
    out = valid & torch.where(adv > 0, rose, fell & (adv < 0))
    weight = torch.clamp(ratio, max=cfg.max_weight).detach()
    logp_c = torch.where(valid, logp.to(ratio.dtype), torch.zeros_like(ratio))  # padding's −inf kept out
    loss_t = torch.where(out, torch.zeros_like(ratio), -adv * weight * logp_c)
    loss = masked_mean(weighted(loss_t, token_weights, valid), valid)
    metrics = ratio_metrics(log_ratio, ratio, out, valid)
    metrics["masked_pos_tokens"] = (out & (adv > 0)).sum().to(ratio.dtype)
    metrics["masked_neg_tokens"] = (out & (adv < 0)).sum().to(ratio.dtype)
    return loss, metrics
