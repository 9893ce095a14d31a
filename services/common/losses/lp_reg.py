"""Lp-Reg: low-probability regularization (Huang et al. 2025, arXiv 2510.03222), as docs/architecture.md
("Lp-Reg, exactly") specifies.

Reference implementation read: CarlanLark/Lp-Reg-dev, `verl/trainer/ppo/core_algos.py`
(`compute_policy_loss_lp_reg`) and `verl/workers/actor/dp_actor.py`. Where it and the definition differ,
this module follows the definition:

- k is computed per call, i.e. per micro-batch, exactly as the paper's code calls the loss once per
  micro-batch. Callers that want a per-mini-batch k must concatenate before calling.
- Ties among equal `logp` break by flat (row-major) position; the paper's `topk(largest=False)` breaks
  them arbitrarily.
- The selection is tensorized (rank < k) instead of `topk` with a host-side `int(...)`, so the loss never
  syncs with the host. Same set of tokens.
- `clip_frac` counts only unregularized tokens: a regularized token's loss has no clipped branch.
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
from sparkrl.services.common.losses.section import CLIP_HIGH, CLIP_LOW, FRACTION, WEIGHT, LossSection

if TYPE_CHECKING:
    from torch import Tensor


class LpRegLoss(LossSection):
    """Lp-Reg (arXiv 2510.03222): PPO-clip plus a pull toward the min-p proxy on the lowest-prob tokens."""

    name: Literal["lp_reg"] = "lp_reg"
    rho: float = Field(
        0.01,
        ge=0,
        le=1,
        description="Fraction of A<0 tokens considered (lowest logp first).",
        json_schema_extra=FRACTION,
    )
    rho_pos: float = Field(
        0.0, ge=0, le=1, description="The same for A>0 tokens (0: off).", json_schema_extra=FRACTION
    )
    beta: float = Field(
        1.0, ge=0, le=100, description="Weight of the kl3 pull toward the proxy.", json_schema_extra=WEIGHT
    )
    clip_low: float = Field(
        1.0, ge=0, le=1, description="ε_low: ratio clipped below at 1 − ε_low.", json_schema_extra=CLIP_LOW
    )
    clip_high: float = Field(
        9.0,
        ge=0,
        le=100,
        description="ε_high: ratio clipped above at 1 + ε_high.",
        json_schema_extra=CLIP_HIGH,
    )


# kl3 saturates at 10 once exp(d) − d − 1 > 10, i.e. d > ~2.6, and d > 0 on every selected token (logp <
# proxy_logp). Capping d at 20 before `exp` therefore changes neither values nor gradients, but keeps
# exp(d) finite (an inf there would turn the clamp's zero gradient into 0·inf = NaN).
_KL3_LOG_RATIO_CAP = 20.0


def select_regularized(
    logp: Tensor, proxy_logp: Tensor, candidates: Tensor, rho: float
) -> tuple[Tensor, Tensor]:
    """Which of `candidates` [B, T] Lp-Reg regularizes.

    k = int(N · ρ) with N = number of candidates; only if k > 1, the k candidates with the lowest current
    `logp` (no gradient through the choice), and of those the ones with logp < proxy_logp. A filtered
    (−inf) proxy never passes the last test. Returns `(regularized [B, T] bool, k 0-d int64)`.
    """
    k = count_fraction(candidates.sum(), rho)
    lowest = select_lowest(logp, candidates, torch.where(k > 1, k, torch.zeros_like(k)))
    return lowest & (logp.detach() < proxy_logp.detach()), k


def kl3_to_proxy(logp: Tensor, proxy_logp: Tensor, regularized: Tensor) -> Tensor:
    """kl3 = clamp(exp(proxy_logp − logp) − (proxy_logp − logp) − 1, −10, 10) on `regularized` tokens,
    exactly 0 elsewhere, all [B, T].

    d = proxy_logp − logp is masked to 0 off the selected tokens *before* the arithmetic, so a −inf proxy
    there contributes neither a value nor a gradient.
    """
    d = proxy_logp.detach().to(logp.dtype) - logp
    d = torch.where(regularized, d, torch.zeros_like(d)).clamp(max=_KL3_LOG_RATIO_CAP)
    return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)


@register_loss(LpRegLoss, zero_advantage_free=True)
def lp_reg_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LpRegLoss,
    *,
    proxy_logp: Tensor,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Lp-Reg policy loss (docs/architecture.md, "Lp-Reg, exactly"). All inputs [B, T]; `cfg` holds ρ,
    ρ_pos, β, ε_low and ε_high; returns (loss, metrics).

        r      = exp(logp − old_logp)
        loss_t = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))                 ordinary tokens
        loss_t = −A·r + β·clamp(exp(proxy_logp − logp) − (proxy_logp − logp) − 1, −10, 10)
                                                                              regularized tokens (no clip)
        loss   = Σ_valid w_t·loss_t / N_valid                      token-mean, w = token_weights or 1

    Regularized: among valid tokens with A < 0, if k_neg = int(N_neg·ρ) > 1, the k_neg with the lowest
    current logp, kept only where logp < proxy_logp; the same with A > 0 and `rho_pos` (0 = off).
    `proxy_logp` may hold −inf (filtered noise token); it is never selected and never yields NaN.
    Gradients flow through `logp` only. All-masked input gives loss 0 (still attached to `logp`).

    Metrics (detached 0-d tensors): `reg_tokens`, `reg_tokens_pos` (counts), `k_neg`, `k_pos`,
    `clip_frac` (valid, unregularized tokens whose clipped branch is active), `ratio_kl`
    (mean old_logp − logp), `ratio_mean`, `kl3_mean` (over regularized tokens; 0 when none),
    `reg_grad_share` (the regularizer's share of the gradient on the tokens it touches: `regularizer_share`).
    """
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    logp_c = logp.to(ratio.dtype)

    base_t, clipped = clipped_surrogate(ratio, adv, cfg.clip_low, cfg.clip_high)
    reg_neg, k_neg = select_regularized(logp_c, proxy_logp, valid & (adv < 0), cfg.rho)
    reg_pos, k_pos = select_regularized(logp_c, proxy_logp, valid & (adv > 0), cfg.rho_pos)
    regularized = reg_neg | reg_pos

    kl3 = kl3_to_proxy(logp_c, proxy_logp, regularized)
    loss_t = torch.where(regularized, -adv * ratio + cfg.beta * kl3, base_t)
    loss_t = weighted(loss_t, token_weights, valid)
    loss = masked_mean(loss_t, valid)

    metrics = ratio_metrics(log_ratio, ratio, clipped & ~regularized, valid)
    with torch.no_grad():
        metrics |= {
            "reg_tokens": reg_neg.sum(),
            "reg_tokens_pos": reg_pos.sum(),
            "k_neg": k_neg,
            "k_pos": k_pos,
            "kl3_mean": masked_mean(kl3, regularized),
            "reg_grad_share": regularizer_share(logp_c, proxy_logp, adv * ratio, kl3, regularized, cfg.beta),
        }
    return loss, metrics


def regularizer_share(
    logp: Tensor, proxy_logp: Tensor, adv_ratio: Tensor, kl3: Tensor, regularized: Tensor, beta: float
) -> Tensor:
    """How much of the loss's gradient on the regularized tokens is the regularizer's: Σ|β·∂kl3/∂logp| /
    (Σ|β·∂kl3/∂logp| + Σ|∂(−A·r)/∂logp|) over them, 0 when none. ∂kl3/∂logp = 1 − exp(proxy_logp − logp)
    below the clamp and 0 at it; ∂(−A·r)/∂logp = −A·r. Near 0: the policy gradient decides those tokens."""
    d = torch.where(regularized, proxy_logp.detach().to(logp.dtype) - logp.detach(), torch.zeros_like(logp))
    reg = torch.where(
        regularized & (kl3 < 10.0), beta * (1.0 - torch.exp(d.clamp(max=_KL3_LOG_RATIO_CAP))), 0.0
    )
    pg = torch.where(regularized, adv_ratio.detach(), torch.zeros_like(logp))
    reg_size, pg_size = reg.abs().sum(), pg.abs().sum()
    return torch.where(reg_size + pg_size > 0, reg_size / (reg_size + pg_size).clamp(min=1e-30), 0.0)
