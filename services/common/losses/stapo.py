"""STAPO: GRPO with its spurious tokens silenced (Liu et al. 2026, "STAPO: Stabilizing Reinforcement Learning
for LLMs by Silencing Rare Spurious Tokens", arXiv 2602.15620). A token of a correct answer inherits the
answer's whole advantage; when the policy gave it a low probability at a position where it was confident
(low entropy), its gradient is large and says little about the answer. The S2T mask silences exactly those
tokens, and the loss is renormalized over the tokens that remain:

    S_t = [A_t > 0] · [π_θ(o_t) < τ_p] · [H_t < τ_h]          (spurious: silenced)
    loss = Σ_t (1 − S_t) · ppo_clip_t / Σ_t (1 − S_t)          over the valid tokens

with ppo_clip_t = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)) and H_t the current policy's entropy at t
(a measurement: no gradient flows through the choice). τ_h is the `entropy_quantile` quantile of H over
the micro-batch's valid tokens. The defaults (τ_p = 0.01, the 5% entropy quantile) are the values the
paper's summaries give; the paper's own table could not be read here. Lp-Reg, in contrast, protects
low-probability tokens of negative-advantage answers: the two act on disjoint tokens.
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


class StapoLoss(LossSection):
    """STAPO: the GRPO surrogate, spurious tokens (A > 0, low probability, low entropy) silenced."""

    name: Literal["stapo"] = "stapo"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.", json_schema_extra=CLIP_LOW)
    clip_high: float = Field(0.2, ge=0, le=100, description="ε_high.", json_schema_extra=CLIP_HIGH)
    prob_threshold: float = Field(
        0.01,
        gt=0,
        le=1,
        description="τ_p: a token of positive advantage whose current probability is below this (and whose "
        "position's entropy is low) is silenced.",
        json_schema_extra={
            "why": {"gt": "at 0 nothing is ever silenced: that is GRPO", "le": "it is a probability"}
        },
    )
    entropy_quantile: float = Field(
        0.05,
        gt=0,
        le=1,
        description="τ_h as a quantile: a position's entropy is low when it is below this quantile of the "
        "entropies of the micro-batch's valid tokens.",
        json_schema_extra={
            "why": {
                "gt": "at 0 no entropy is below the threshold: nothing is silenced",
                "le": "it is a quantile",
            }
        },
    )


@register_loss(StapoLoss, zero_advantage_free=True, own_aggregation=True)
def stapo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: StapoLoss,
    *,
    entropy: Tensor,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """The module docstring's loss. `spurious_tokens` counts the tokens silenced, `entropy_threshold` is
    τ_h as found."""
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    loss_t, clipped = clipped_surrogate(ratio, adv, cfg.clip_low, cfg.clip_high)
    with torch.no_grad():
        entropy_c = entropy.detach().to(ratio.dtype)
        tau_h = (
            torch.quantile(entropy_c[valid], cfg.entropy_quantile) if valid.any() else entropy_c.new_zeros(())
        )
        logp_c = torch.where(valid, logp.detach().to(ratio.dtype), torch.zeros_like(ratio))
        spurious = valid & (adv > 0) & (logp_c < torch.log(ratio.new_tensor(cfg.prob_threshold)))
        spurious &= entropy_c < tau_h
    kept = valid & ~spurious
    loss = masked_mean(weighted(loss_t, token_weights, valid), kept)
    metrics = ratio_metrics(log_ratio, ratio, clipped, valid)
    metrics["spurious_tokens"] = spurious.sum().to(ratio.dtype)
    metrics["entropy_threshold"] = tau_h
    return loss, metrics
