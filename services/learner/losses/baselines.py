"""The baselines the Lp-Reg paper compares against, one pure function each. All tensors [B, T]; each
returns (loss, metrics) with at least `clip_frac` and `ratio_kl` (see `common.py` for the conventions).

Sources read for definitions and defaults: verl `verl/trainer/ppo/core_algos.py` (`compute_policy_loss`,
`compute_policy_loss_clip_cov`, `compute_policy_loss_kl_cov`, `compute_policy_loss_gspo`,
`kl_penalty`) and its `ppo_trainer.yaml`; the Lp-Reg authors' fork CarlanLark/Lp-Reg-dev (same file, plus
`compute_policy_loss_8020_split`). Every selection here is tensorized with deterministic ties (flat
position), where verl's `topk` breaks ties arbitrarily.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparkrl.services.learner.losses.common import (
    Metrics,
    apply_is_weights,
    clipped_surrogate,
    count_fraction,
    masked_mean,
    prepare,
    ratio_metrics,
    select_lowest,
)


def _centered_cov(adv: Tensor, logp: Tensor, valid: Tensor) -> Tensor:
    """Per-token covariance term (A_t − mean A)·(logp_t − mean logp), means over valid tokens, detached."""
    logp_d = logp.detach().to(adv.dtype)
    return (adv - masked_mean(adv, valid)) * (logp_d - masked_mean(logp_d, valid))


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """PPO-clip / GRPO (Schulman et al. 2017; Shao et al. 2024), token-mean:

        loss = mean_valid max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)),   r = exp(logp − old_logp)

    No dual-clip: the Lp-Reg authors' fork has verl's dual-clip (clip_ratio_c) commented out.
    """
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    loss_t, clipped = clipped_surrogate(ratio, adv, clip_low, clip_high)
    loss = masked_mean(apply_is_weights(loss_t, is_weights, valid), valid)
    return loss, ratio_metrics(log_ratio, ratio, clipped, valid)


def clip_higher_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Clip-Higher (DAPO, Yu et al. 2025): PPO-clip with an asymmetric range, ε_low = 0.2, ε_high = 0.28."""
    return ppo_clip_loss(
        logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high, is_weights=is_weights
    )


def entropy_bonus_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    entropy: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    entropy_coef: float = 0.001,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """GRPO + entropy loss: loss = mean_valid [ppo_clip_t − c·H_t], H_t the current policy's entropy.

    c = 0.001 is verl's historical `actor.entropy_coeff` default (the Lp-Reg fork's yaml sets 0, i.e. the
    bonus off, for its own runs). `entropy` must carry gradient for the bonus to act.
    """
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    ppo_t, clipped = clipped_surrogate(ratio, adv, clip_low, clip_high)
    entropy_c = torch.where(valid, entropy.to(ratio.dtype), torch.zeros_like(ratio))
    loss_t = ppo_t - entropy_coef * entropy_c
    loss = masked_mean(apply_is_weights(loss_t, is_weights, valid), valid)
    metrics = ratio_metrics(log_ratio, ratio, clipped, valid)
    metrics["entropy"] = masked_mean(entropy_c.detach(), valid)
    return loss, metrics


def eighty_twenty_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    entropy: Tensor,
    *,
    top_frac: float = 0.2,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Beyond the 80/20 rule (Wang et al. 2025): policy gradient on the high-entropy forking tokens only.

        S    = the max(1, int(N_valid · 0.2)) valid tokens with the highest entropy (detached choice)
        loss = Σ_{t∈S} clip_higher_t / |S|

    The mean over S only, as in the Lp-Reg fork (`compute_policy_loss_8020_split` shrinks the mask).
    """
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    loss_t, clipped = clipped_surrogate(ratio, adv, clip_low, clip_high)
    n_top = count_fraction(valid.sum(), top_frac, at_least_one=True)
    top = select_lowest(-entropy.detach().float(), valid, n_top)
    loss = masked_mean(apply_is_weights(loss_t, is_weights, valid), top)
    metrics = ratio_metrics(log_ratio, ratio, clipped, valid)
    with torch.no_grad():
        metrics["clip_frac"] = masked_mean(clipped.to(ratio.dtype), top)  # among trained tokens, as verl
        metrics["trained_frac"] = masked_mean(top.to(ratio.dtype), valid)
    return loss, metrics


def kl_cov_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 1.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """KL-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"), verl's definition:

        cov_t  = (A_t − mean A)·(logp_t − mean logp)          means over valid tokens, detached
        S      = the max(1, int(N_valid · kl_cov_ratio)) valid tokens with the largest cov_t
        loss_t = −A·r + c·|logp − old_logp|   for t ∈ S;   −A·r otherwise   (no ratio clip at all)
        loss   = token-mean

    `clip_frac` is 0 (nothing is clipped); `reg_frac` is |S| / N_valid; `kl_abs` is mean |log r|.
    """
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    n_reg = count_fraction(valid.sum(), kl_cov_ratio, at_least_one=True)
    selected = select_lowest(-_centered_cov(adv, logp, valid), valid, n_reg)
    pg_t = -adv * ratio
    loss_t = torch.where(selected, pg_t + ppo_kl_coef * log_ratio.abs(), pg_t)
    loss = masked_mean(apply_is_weights(loss_t, is_weights, valid), valid)
    metrics = ratio_metrics(log_ratio, ratio, torch.zeros_like(valid), valid)
    with torch.no_grad():
        metrics["reg_frac"] = masked_mean(selected.to(ratio.dtype), valid)
        metrics["kl_abs"] = masked_mean(log_ratio.abs(), valid)
    return loss, metrics


def clip_cov_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Clip-Cov (Cui et al. 2025), verl's definition:

        cov_t  = (A_t − mean A)·(logp_t − mean logp)          means over valid tokens, detached
        C      = valid tokens not already PPO-clipped with lb < cov_t < ub
        S      = min(max(1, int(N_valid · clip_cov_ratio)), |C|) tokens drawn uniformly from C
        loss_t = 0 for t ∈ S (no gradient);   max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)) otherwise
        loss   = token-mean (S still counts in the denominator, as in verl)

    The draw uses `generator` (uniform keys, k smallest) so runs are reproducible. ε defaults to verl's
    `clip_ratio` 0.2; Cui et al.'s recipe ran with clip_ratio_low = clip_ratio_high = 1 — pass them.
    `clip_frac` is the PPO-clip fraction; `cov_clip_frac` is |S| / N_valid (verl's "pg_clipfrac").
    """
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    ppo_t, clipped = clipped_surrogate(ratio, adv, clip_low, clip_high)
    cov = _centered_cov(adv, logp, valid)
    candidates = valid & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    n_clip = count_fraction(valid.sum(), clip_cov_ratio, at_least_one=True)
    draw = torch.rand(cov.shape, generator=generator, device=cov.device)
    detached = select_lowest(draw, candidates, n_clip)
    loss_t = torch.where(detached, torch.zeros_like(ppo_t), ppo_t)
    loss = masked_mean(apply_is_weights(loss_t, is_weights, valid), valid)
    metrics = ratio_metrics(log_ratio, ratio, clipped, valid)
    metrics["cov_clip_frac"] = masked_mean(detached.to(ratio.dtype), valid)
    return loss, metrics


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """GSPO (Zheng et al. 2025), sequence-level ratio with verl's token-level gradient form:

        log s_i   = mean_{t valid} (logp_{i,t} − old_logp_{i,t})
        s_{i,t}   = sg[s_i] · exp(logp_{i,t} − sg[logp_{i,t}])          (value s_i, gradient of logp)
        loss_{i,t} = max(−A·s_{i,t}, −A·clip(s_{i,t}, 1 − 3e-4, 1 + 4e-4))
        loss      = mean over sequences with ≥ 1 valid token of (mean over its valid tokens)

    log s_{i,t} is capped at 10 before `exp`, as verl does. verl's seq-mean divides by all B rows; rows
    with no valid token are left out here so an empty row cannot dilute the loss.
    """
    valid, log_ratio, ratio, adv = prepare(logp, old_logp, advantages, mask)
    n_tokens = valid.sum(dim=-1)  # [B]
    log_s = log_ratio.sum(dim=-1) / n_tokens.clamp(min=1)  # [B]
    logp_c = logp.to(log_ratio.dtype)
    log_s_t = (log_s.detach().unsqueeze(-1) + logp_c - logp_c.detach()).clamp(max=10.0)  # [B, T]
    s_t = torch.exp(torch.where(valid, log_s_t, torch.zeros_like(log_s_t)))
    loss_t, clipped = clipped_surrogate(s_t, adv, clip_low, clip_high)
    loss_t = apply_is_weights(loss_t, is_weights, valid)
    seq_loss = torch.where(valid, loss_t, torch.zeros_like(loss_t)).sum(dim=-1) / n_tokens.clamp(min=1)
    nonempty = n_tokens > 0  # [B]
    loss = masked_mean(seq_loss, nonempty)
    metrics = ratio_metrics(log_ratio, ratio, clipped, valid)
    metrics["seq_ratio_mean"] = masked_mean(torch.exp(log_s.detach()), nonempty)
    return loss, metrics
