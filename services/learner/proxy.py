"""Lp-Reg's proxy distribution (docs/architecture.md, "Lp-Reg, exactly"): π_old at the sampling
temperature, min-p filtered (keep p ≥ κ·max p), renormalized; we need the log proxy probability of each
sampled token.

A filtered token's proxy log-prob is **−inf** (`FILTERED_LOGP`): it is the exact log 0, it can never pass
Lp-Reg's `logp < proxy_logp` test, and `lp_reg_loss` masks it before any arithmetic, so it never turns
into NaN there. Code that averages proxy log-probs must mask them first.

Two ways to get it:

- `proxy_logp_from_logits` — the reference: one extra π_old forward over the full vocabulary. Exact.
- `proxy_logp_from_topk` — from the rollout's top-k log-probs, free. Exact where the k-th top probability
  is already below κ·max p (the kept set then lies inside the top-k); elsewhere an approximation whose
  error is bounded by the mass missing from the top-k. `exact` says which.

The authors' code (CarlanLark/Lp-Reg-dev `dp_actor.apply_min_p`) applies min-p to the raw logits and
divides by the temperature afterwards; the definition filters "at the sampling temperature", which is
what is done here. The two agree at temperature 1.0, the paper's setting.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FILTERED_LOGP = float("-inf")


def _log_kappa(kappa: float) -> float:
    if not 0.0 <= kappa <= 1.0:
        raise ValueError(f"kappa must be in [0, 1], got {kappa}")
    return math.log(kappa) if kappa > 0.0 else float("-inf")


@torch.no_grad()
def _proxy_rows(logits_rows: Tensor, token_rows: Tensor, log_kappa: float, temperature: float) -> Tensor:
    """Proxy log-prob for `logits_rows` [N, V] and sampled `token_rows` [N] → [N] float32.

    Works on logits, not log-probs: p_v ≥ κ·max p ⇔ x_v ≥ max x + log κ (the softmax normalizer cancels),
    and the renormalized proxy is log p̃ = x_tok − logsumexp_{kept} x. One float32 [N, V] buffer is
    allocated and then reused in place for the filter and the exp.
    """
    x = logits_rows.to(torch.float32, copy=True)  # [N, V]; copy: the in-place ops below must not alias
    x.div_(temperature)
    x_max = x.amax(dim=-1, keepdim=True)  # [N, 1]
    x_tok = x.gather(-1, token_rows.unsqueeze(-1))  # [N, 1]
    threshold = x_max + log_kappa  # [N, 1]
    x.masked_fill_(x < threshold, float("-inf"))
    # logsumexp over the kept set, in place: the max itself is kept, so the sum is ≥ 1 and log is finite.
    lse_kept = x_max + x.sub_(x_max).exp_().sum(dim=-1, keepdim=True).log_()  # [N, 1]
    proxy = torch.where(x_tok >= threshold, x_tok - lse_kept, FILTERED_LOGP)
    # A row with no finite logit (never a real sampled position) would give NaN; report it as filtered.
    return torch.nan_to_num(proxy, nan=FILTERED_LOGP, neginf=FILTERED_LOGP).squeeze(-1)


def proxy_logp_from_logits(
    logits: Tensor,
    token_ids: Tensor,
    kappa: float = 0.02,
    temperature: float = 1.0,
    *,
    chunk_rows: int = 256,
) -> Tensor:
    """Exact proxy log-prob of each sampled token from π_old's full logits.

    logits [B, T, V] (any float dtype; computed in float32), token_ids [B, T] → proxy_logp [B, T] float32,
    −inf where the sampled token is filtered out. Rows are processed `chunk_rows` at a time so the only
    full-vocabulary temporaries are one float32 [chunk_rows, V] buffer and its bool filter mask (≈ 150 MiB
    at V = 151,936), whatever B·T is. No gradient is recorded, even if `logits` requires grad.
    """
    B, T, V = logits.shape
    if token_ids.shape != (B, T):
        raise ValueError(f"token_ids must be [B, T] = {(B, T)}, got {tuple(token_ids.shape)}")
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_kappa = _log_kappa(kappa)
    logits_rows = logits.detach().reshape(B * T, V)  # [B*T, V], a view
    token_rows = token_ids.reshape(B * T).to(torch.long)  # [B*T]
    out = torch.empty(B * T, dtype=torch.float32, device=logits.device)
    for start in range(0, B * T, chunk_rows):
        rows = slice(start, start + chunk_rows)
        out[rows] = _proxy_rows(logits_rows[rows], token_rows[rows], log_kappa, temperature)
    return out.view(B, T)


@torch.no_grad()
def proxy_logp_from_topk(
    token_ids: Tensor, topk_ids: Tensor, topk_logp: Tensor, kappa: float = 0.02
) -> tuple[Tensor, Tensor]:
    """Proxy log-prob of each sampled token from the rollout's top-k, plus where that is exact.

    token_ids [B, T]; topk_ids, topk_logp [B, T, K]: the K most likely tokens of the sampling distribution
    (at its temperature) and their log-probs, sorted descending. Returns
    (proxy_logp [B, T] float32, −inf where filtered; exact [B, T] bool).

        kept   = {j : topk_logp_j ≥ log κ + topk_logp_0}
        proxy  = topk_logp_tok − logsumexp_{j∈kept} topk_logp_j    if the sampled token is in kept, else −inf
        exact  = topk_logp_{K−1} < log κ + topk_logp_0             (no kept token can lie beyond the top-k)

    Where exact, a sampled token absent from the top-k is correctly filtered (its p < p_{K−1} < κ·max p).
    """
    B, T, K = topk_logp.shape
    if token_ids.shape != (B, T) or topk_ids.shape != (B, T, K):
        raise ValueError(
            f"expected token_ids [B, T] and topk_ids [B, T, K] = {(B, T, K)}, "
            f"got {tuple(token_ids.shape)} and {tuple(topk_ids.shape)}"
        )
    log_kappa = _log_kappa(kappa)
    logp = topk_logp.to(torch.float32)  # [B, T, K]
    threshold = logp[..., :1] + log_kappa  # [B, T, 1]
    kept = logp >= threshold  # [B, T, K]
    normalizer = torch.logsumexp(logp.masked_fill(~kept, float("-inf")), dim=-1)  # [B, T]
    is_token = (topk_ids == token_ids.unsqueeze(-1)) & kept  # [B, T, K]
    token_logp = logp.masked_fill(~is_token, float("-inf")).amax(dim=-1)  # [B, T]
    proxy = torch.where(is_token.any(dim=-1), token_logp - normalizer, FILTERED_LOGP)
    exact = logp[..., -1] < threshold.squeeze(-1)
    return proxy, exact
