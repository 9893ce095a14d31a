"""Pieces every policy loss shares: the masked token-mean, the clipped surrogate, ratio metrics, and a
deterministic "k lowest among candidates" selection.

Conventions for every loss in this package:

- All per-token tensors are `[B, T]`; `mask` is bool or 0/1 (nonzero = valid token).
- Gradients flow through `logp` (and `entropy` where a loss uses it) only; `old_logp`, `advantages`,
  `proxy_logp` and `is_weights` are detached on entry.
- Masked positions are sanitized *before* any `exp`, so padding garbage (−inf, NaN) never leaks into the
  loss or its gradient.
- Metrics are detached 0-d tensors (no host sync inside the loss); the learner calls `.item()` once per
  step when it logs them, under the `loss/` namespace.
"""

from __future__ import annotations

import torch
from torch import Tensor

Metrics = dict[str, Tensor]


def compute_dtype(logp: Tensor) -> torch.dtype:
    """float32 for bf16/fp16 inputs (exp and sums lose too much in half precision), float64 stays."""
    return torch.promote_types(logp.dtype, torch.float32)


def valid_mask(mask: Tensor) -> Tensor:
    """`mask` [B, T] (bool or 0/1) → bool [B, T]."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_mean(x: Tensor, valid: Tensor) -> Tensor:
    """Mean of `x` [B, T] over `valid` [B, T] positions; 0 when none is valid (never NaN).

    `torch.where` rather than `x * valid`: a NaN/inf at a masked position must not survive (0·inf = NaN).
    """
    total = torch.where(valid, x, torch.zeros_like(x)).sum()
    return total / valid.sum().clamp(min=1)


def apply_is_weights(loss_t: Tensor, is_weights: Tensor | None, valid: Tensor) -> Tensor:
    """Multiply each token's loss `loss_t` [B, T] by its truncated-IS weight; identity when `None`.

    Masked weights are zeroed first, so a NaN weight on padding cannot poison the backward pass.
    """
    if is_weights is None:
        return loss_t
    w = torch.where(valid, is_weights.detach().to(loss_t.dtype), torch.zeros_like(loss_t))
    return loss_t * w


def log_ratio_and_ratio(logp: Tensor, old_logp: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """log r = logp − old_logp and r = exp(log r), both [B, T], with masked positions set to log r = 0.

    Zeroing before `exp` keeps padding (e.g. logp = −inf) from producing inf·0 = NaN in the gradient.
    """
    dtype = compute_dtype(logp)
    log_ratio = logp.to(dtype) - old_logp.detach().to(dtype)
    log_ratio = torch.where(valid, log_ratio, torch.zeros_like(log_ratio))
    return log_ratio, torch.exp(log_ratio)


def prepare(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What every ratio-based loss starts from: valid [B, T] bool, log r, r, and A (detached, 0 on masked
    tokens), in the compute dtype."""
    valid = valid_mask(mask)
    log_ratio, ratio = log_ratio_and_ratio(logp, old_logp, valid)
    adv = torch.where(valid, advantages.detach().to(ratio.dtype), torch.zeros_like(ratio))
    return valid, log_ratio, ratio, adv


def clipped_surrogate(ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate, per token.

        loss_t = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))

    Returns `(loss_t [B, T], clipped [B, T] bool)` where `clipped` marks tokens whose clipped branch is the
    active (strictly larger) one — the tokens that get no gradient from the clip.
    """
    unclipped = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped_loss), clipped_loss > unclipped


def ratio_metrics(log_ratio: Tensor, ratio: Tensor, clipped: Tensor, valid: Tensor) -> Metrics:
    """`clip_frac`, `ratio_kl` (masked mean of old_logp − logp, the usual k1 approx-KL), `ratio_mean`."""
    with torch.no_grad():
        return {
            "clip_frac": masked_mean(clipped.to(ratio.dtype), valid),
            "ratio_kl": masked_mean(-log_ratio, valid),
            "ratio_mean": masked_mean(ratio, valid),
        }


def select_lowest(key: Tensor, candidates: Tensor, k: Tensor) -> Tensor:
    """Bool [B, T]: the `k` candidates with the smallest `key` (all candidates if fewer than k).

    `key` [B, T] is only compared (no gradient); `k` is a 0-d integer tensor, so the caller never has to
    sync with the host to size a `topk`. Ties break deterministically by flat position (row-major,
    earlier first): two stable sorts, first by key, then candidates before non-candidates.
    """
    flat_key = key.detach().reshape(-1)
    flat_candidates = candidates.reshape(-1)
    order = torch.sort(flat_key, stable=True).indices
    # Second stable pass moves candidates ahead of everything else while keeping their key order; a
    # candidate whose key is +inf or NaN still outranks every non-candidate.
    order = order[torch.sort((~flat_candidates[order]).to(torch.uint8), stable=True).indices]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return candidates & (rank.view(key.shape) < k)


def count_fraction(n: Tensor, frac: float, *, at_least_one: bool = False) -> Tensor:
    """int(n · frac) as a 0-d int64 tensor, computed in float64 so it equals Python's `int(n * frac)`.

    `at_least_one` gives max(1, int(n · frac)) when n > 0 (the convention of verl's KL-Cov, Clip-Cov and
    80/20 selections); it stays 0 when n == 0.
    """
    k = torch.floor(n.to(torch.float64) * frac).to(torch.int64)
    if at_least_one:
        k = torch.where(n > 0, k.clamp(min=1), k)
    return k
