"""Rollout/learner mismatch corrections: the importance weights every ratio-based loss takes through
`LossInputs.token_weights`, from π_old as the learner recomputes it (`learner.old_logp_source:
recompute`) and the log-probs the rollout engine reported for the same tokens.

The rollout engine (vLLM, bf16 kernels, weights a version behind) samples from π_rollout, the loss
assumes π_old = π_learner. Per valid token t, ρ_t = π_learner(o_t) / π_rollout(o_t); per sequence i,
ρ_i = Π_t ρ_t = exp(Σ_t log ρ_t) over its valid tokens.

- **Truncated IS** (TIS; `learner.tis_cap` C, `learner.tis_level`): w = min(ρ, C), ρ the token's
  (`token`) or its sequence's (`sequence`: every token of a sequence alike). verl calls it `rollout_is:
  token|sequence` with `rollout_is_threshold` (before: `actor.tis_imp_ratio_cap`); TRL
  `vllm_importance_sampling_mode: token_truncate|sequence_truncate` with `vllm_importance_sampling_cap`.
- **Masked IS** (`learner.is_mask`, the band [α, β] = `is_mask_low`, `is_mask_high`): a token (`token`)
  or a whole sequence (`sequence`) whose ratio leaves the band gets weight 0; the others keep theirs
  (truncated, or the raw ratio when `tis_cap` is None). With `token` and no cap this is IcePop (Ring-1T:
  M(ρ; α, β) = ρ inside [α, β], 0 outside; α 0.5, β 5 there and in prime-rl); verl calls the mask
  `rollout_rs: token|sequence` with `rollout_rs_threshold_lower` / `rollout_rs_threshold`, TRL
  `token_mask|sequence_mask` (its band has only the upper side).

A masked token stays in the token mean's divisor, as IcePop's 1/Σ|y| and TRL's masks keep it (verl's
rejection sampling takes it out of the response mask): its loss term is 0, no other token's weight
changes. The weights are constants (no gradient) and 0 on padding. A row is one sequence (padded
collation): the sequence levels refuse packing and shared prompts (the learner's settings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparkrl.services.common.losses.ops import torch

if TYPE_CHECKING:
    from torch import Tensor

UNCAPPED_LOG = 30.0  # e^30 ≈ 1e13: a raw ratio this large is finite in float32 and swamps any loss anyway

# The statistics `correction_weights` measures per micro-batch: counts add up over micro-batches, updates
# and ranks; the rest are token means (the learner weights them by each micro-batch's share of tokens).
COUNT_STATS = ("tis_capped_tokens", "is_masked_tokens", "is_capped_seqs", "is_masked_seqs", "is_seqs")
MEAN_STATS = ("tis_weight_mean", "is_capped_share", "is_masked_share", "mismatch_kl", "mismatch_k3")


@dataclass(frozen=True)
class Correction:
    """What to do with ρ: truncate it at `cap` (None: no truncation) at `level`, and give weight 0 to the
    tokens (`mask` token) or sequences (`mask` sequence) whose ratio leaves [low, high] (`mask` none:
    nothing masked). Neither: no weights at all, the statistics alone."""

    cap: float | None = 2.0
    level: str = "token"  # token | sequence: the ratio `cap` truncates
    mask: str = "none"  # none | token | sequence: the ratio the band is checked on
    low: float = 0.5
    high: float = 5.0

    @property
    def weighs(self) -> bool:
        return self.cap is not None or self.mask != "none"


def log_ratios(learner_logp: Tensor, rollout_logp: Tensor, valid: Tensor) -> Tensor:
    """log ρ_t = log π_learner − log π_rollout [B, T], detached, 0 on masked tokens (padding may hold −inf).
    In float64: a ratio exactly at the band's edge compares as the edge (a [B, T] tensor: cheap)."""
    log_r = learner_logp.detach().double() - rollout_logp.detach().double()
    return torch.where(valid, log_r, torch.zeros_like(log_r))


def sequence_log_ratios(log_r: Tensor) -> Tensor:
    """log ρ_i = Σ_t log ρ_t of each row's sequence, on every position of the row [B, T] (`log_r` is 0 on
    masked positions, so the sum is over the valid ones)."""
    return log_r.sum(dim=-1, keepdim=True).expand_as(log_r)


@torch.no_grad()
def correction_weights(
    learner_logp: Tensor, rollout_logp: Tensor, mask: Tensor, correction: Correction
) -> tuple[Tensor | None, dict[str, float]]:
    """The correction's per-token weights [B, T] (None when it neither truncates nor masks) and its
    statistics (`COUNT_STATS`, `MEAN_STATS`: how many tokens and sequences were capped or masked, the mean
    weight, and the mismatch KL(π_rollout ‖ π_learner), k1 = E[−log ρ] and k3 = E[ρ − 1 − log ρ] over the
    valid tokens, which the rollout sampled)."""
    valid = mask.bool()
    log_tok = log_ratios(learner_logp, rollout_logp, valid)
    log_seq = sequence_log_ratios(log_tok)
    log_w = log_tok if correction.level == "token" else log_seq
    cap = correction.cap
    # Bound the exponent so exp never overflows (above log(cap) the weight is the cap anyway), then cap.
    weights = torch.exp(log_w.clamp(max=math.log(cap) + 1.0 if cap is not None else UNCAPPED_LOG))
    capped = valid & (log_w > math.log(cap)) if cap is not None else torch.zeros_like(valid)
    if cap is not None:
        weights = weights.clamp(max=cap)
    masked = torch.zeros_like(valid)
    if correction.mask != "none":
        log_m = log_tok if correction.mask == "token" else log_seq
        low = math.log(correction.low) if correction.low > 0 else -math.inf
        masked = valid & ((log_m < low) | (log_m > math.log(correction.high)))
        weights = torch.where(masked, torch.zeros_like(weights), weights)
    capped = capped & ~masked  # a masked token's weight is 0, not the cap
    weights = torch.where(valid, weights, torch.zeros_like(weights)).float()
    return (weights if correction.weighs else None), _stats(log_tok, weights, capped, masked, valid)


def _stats(
    log_tok: Tensor, weights: Tensor, capped: Tensor, masked: Tensor, valid: Tensor
) -> dict[str, float]:
    n = max(int(valid.sum()), 1)
    rows = valid.any(dim=-1)  # [B]: a row with a valid token is one sequence
    ratio = torch.exp(log_tok.clamp(max=UNCAPPED_LOG))
    k3 = torch.where(valid, ratio - 1.0 - log_tok, torch.zeros_like(log_tok))
    return {
        "tis_capped_tokens": float(capped.sum()),
        "is_masked_tokens": float(masked.sum()),
        "is_capped_seqs": float((capped.any(dim=-1) & rows).sum()),
        "is_masked_seqs": float((masked.any(dim=-1) & rows).sum()),
        "is_seqs": float(rows.sum()),
        "tis_weight_mean": float(weights.sum()) / n,
        "is_capped_share": float(capped.sum()) / n,
        "is_masked_share": float(masked.sum()) / n,
        "mismatch_kl": float(-log_tok.sum()) / n,
        "mismatch_k3": float(k3.sum()) / n,
    }
