"""Loss aggregation (`learner.loss_aggregation`): how a step's per-token losses become one number.

Every loss is written as a token mean (`masked_mean`, as the paper and docs/architecture.md ("Lp-Reg,
exactly") define them). The other modes are that token mean over re-weighted tokens: with N tokens and S
sequences in the update (a sequence: a completion with at least one token; ℓ_i its length, L a
constant), token t of sequence i gets

    token_mean           w = 1                 → Σ_t loss_t / N
    seq_mean_token_sum   w = N / S             → (1/S) Σ_i Σ_t loss_t
    seq_mean_token_mean  w = N / (S · ℓ_i)     → (1/S) Σ_i (1/ℓ_i) Σ_t loss_t
    dr_grpo              w = N / (S · L)       → Σ_i Σ_t loss_t / (S · L)   (Dr. GRPO: a constant length)

applied like truncated-IS weights (they multiply into them), so each loss's own formula stays as written.
80/20 averages over its selected tokens and GSPO over sequences by definition: they keep their own.
"""

from __future__ import annotations

import torch
from torch import Tensor

MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "dr_grpo")


def aggregation_weights(
    mask: Tensor, mode: str, total_tokens: int, total_sequences: int, norm_length: int | None = None
) -> Tensor | None:
    """Per-token weights [B, T] for one micro-batch (`mask` its valid tokens) of an update with
    `total_tokens` and `total_sequences`; None for token_mean (no re-weighting)."""
    if mode == "token_mean":
        return None
    if mode not in MODES:
        raise ValueError(f"unknown loss aggregation {mode!r} ({', '.join(MODES)})")
    valid = mask.bool()
    scale = total_tokens / max(total_sequences, 1)
    if mode == "seq_mean_token_sum":
        per_row = torch.full((mask.shape[0], 1), scale)
    elif mode == "seq_mean_token_mean":
        per_row = scale / valid.sum(dim=-1, keepdim=True).clamp(min=1).float()
    else:
        if not norm_length:
            raise ValueError("dr_grpo divides by a constant length: the rollout's max_new_tokens")
        per_row = torch.full((mask.shape[0], 1), scale / norm_length)
    return torch.where(valid, per_row.to(torch.float32).expand_as(mask), torch.zeros(mask.shape))


def sequences(mask: Tensor) -> int:
    """Completions with at least one token in the micro-batch."""
    return int(mask.bool().any(dim=-1).sum())
