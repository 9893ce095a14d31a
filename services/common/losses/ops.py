"""Pieces every policy loss shares: the masked token-mean, the clipped surrogate, ratio metrics, and a
deterministic "k lowest among candidates" selection; and `torch`, loaded on first use.

Conventions for every loss in this package:

- All per-token tensors are `[B, T]`; `mask` is bool or 0/1 (nonzero = valid token).
- Gradients flow through `logp` (and `entropy` where a loss uses it) only; `old_logp`, `advantages`,
  `proxy_logp` and `token_weights` are detached on entry.
- Masked positions are sanitized *before* any `exp`, so padding garbage (−inf, NaN) never leaks into the
  loss or its gradient.
- Metrics are detached 0-d tensors (no host sync inside the loss); the learner calls `.item()` once per
  step when it logs them, under the `loss/` namespace.
- `proxy_logp`, `entropy` and `token_weights` are keyword arguments a loss takes only if it uses them
  (the registry passes what the signature names).

`torch` here is the module, imported at its first use: the control service, the settings tree and the
CLI import the losses for their settings classes only (a live value is checked against the loss's
bounds) and never pay for torch (≈ 2 s and 180 MB a process). The loss modules take it from here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


class _Torch:
    """`torch`, imported on the first attribute looked up (then a dictionary lookup per use)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("torch"), name)


torch: Any = _Torch()

Metrics = dict[str, "Tensor"]


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


def weighted(loss_t: Tensor, token_weights: Tensor | None, valid: Tensor) -> Tensor:
    """Each token's loss `loss_t` [B, T] times its weight (the aggregation's, and the mismatch
    correction's); the identity when `None`. Masked weights are zeroed first, so a NaN weight on padding
    cannot poison the backward pass."""
    if token_weights is None:
        return loss_t
    w = torch.where(valid, token_weights.detach().to(loss_t.dtype), torch.zeros_like(loss_t))
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


def centered_cov(adv: Tensor, logp: Tensor, valid: Tensor) -> Tensor:
    """Per-token covariance term (A_t − mean A)·(logp_t − mean logp), means over valid tokens, detached
    (KL-Cov's and Clip-Cov's choice of tokens)."""
    logp_d = logp.detach().to(adv.dtype)
    return (adv - masked_mean(adv, valid)) * (logp_d - masked_mean(logp_d, valid))


def count_fraction(n: Tensor, frac: float, *, at_least_one: bool = False) -> Tensor:
    """int(n · frac) as a 0-d int64 tensor, computed in float64 so it equals Python's `int(n * frac)`.

    `at_least_one` gives max(1, int(n · frac)) when n > 0 (the convention of verl's KL-Cov, Clip-Cov and
    80/20 selections); it stays 0 when n == 0.
    """
    k = torch.floor(n.to(torch.float64) * frac).to(torch.int64)
    if at_least_one:
        k = torch.where(n > 0, k.clamp(min=1), k)
    return k
