"""GSPO (Zheng et al. 2025): the importance ratio of the whole sequence, with verl's token-level gradient
form.

Source read: verl `verl/trainer/ppo/core_algos.py` (`compute_policy_loss_gspo`).
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


class GspoLoss(LossSection):
    """GSPO: sequence-level importance ratio."""

    name: Literal["gspo"] = "gspo"
    clip_low: float = Field(
        3e-4, ge=0, le=1, description="ε_low on the sequence ratio.", json_schema_extra=CLIP_LOW
    )
    clip_high: float = Field(
        4e-4, ge=0, le=100, description="ε_high on the sequence ratio.", json_schema_extra=CLIP_HIGH
    )


@register_loss(GspoLoss, sequence_level=True)
def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: GspoLoss,
    *,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """log s_i   = mean_{t valid} (logp_{i,t} − old_logp_{i,t})
        s_{i,t}   = sg[s_i] · exp(logp_{i,t} − sg[logp_{i,t}])          (value s_i, gradient of logp)
        loss_{i,t} = max(−A·s_{i,t}, −A·clip(s_{i,t}, 1 − 3e-4, 1 + 4e-4))
        loss      = mean over sequences with ≥ 1 valid token of (mean over its valid tokens)

    A row is one sequence. log s_{i,t} is capped at 10 before `exp`, as verl does. verl's seq-mean divides
    by all B rows; rows with no valid token are left out here so an empty row cannot dilute the loss.
    """
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    n_tokens = valid.sum(dim=-1)  # [B]
    log_s = log_ratio.sum(dim=-1) / n_tokens.clamp(min=1)  # [B]
    logp_c = logp.to(log_ratio.dtype)
    log_s_t = (log_s.detach().unsqueeze(-1) + logp_c - logp_c.detach()).clamp(max=10.0)  # [B, T]
    s_t = torch.exp(torch.where(valid, log_s_t, torch.zeros_like(log_s_t)))
    loss_t, clipped = clipped_surrogate(s_t, adv, cfg.clip_low, cfg.clip_high)
    loss_t = weighted(loss_t, token_weights, valid)
    seq_loss = torch.where(valid, loss_t, torch.zeros_like(loss_t)).sum(dim=-1) / n_tokens.clamp(min=1)
    nonempty = n_tokens > 0  # [B]
    loss = masked_mean(seq_loss, nonempty)
    metrics = ratio_metrics(log_ratio, ratio, clipped, valid)
    metrics["seq_ratio_mean"] = masked_mean(torch.exp(log_s.detach()), nonempty)
    return loss, metrics
