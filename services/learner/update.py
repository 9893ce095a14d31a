"""A step's update, in one scroll: groups → advantages → mini-batches → micro-batches → π_old → for each
update: forward, loss and backward per micro-batch → one optimizer step (`run_updates`, then its parts).

Words (learner.py has them all): a *step* trains one batch of groups; an *update* is one optimizer step,
over one *mini-batch* (the step's groups cut into `learner.updates_per_rollout` contiguous parts at group
boundaries: one by default); a *micro-batch* is one forward/backward, as many padded rows as
`learner.micro_batch_tokens` holds.

With N updates per step, each mini-batch is its own update against the same π_old (computed for every
micro-batch before the first update): from the second on the ratio moves off 1, and the loss's clipping
keeps the weights near π_old (the paper's off-policy setting uses 8). The version still advances once per
step: the fleet gets one new version per rollout batch.

An update's loss is the token-mean over all its tokens: each micro-batch's token-mean is weighted by its
share of the tokens, its tokens re-weighted for `learner.loss_aggregation` (aggregation.py). An update whose
loss or gradient norm is not finite is not applied (`apply_gradients`) and the step's later updates are
not taken: the learner commits the groups the applied ones trained (`split_applied`) and sends the rest
back, or dead-letters a group whose loss alone is not finite (`loss_is_finite`).

A data-parallel learner (ranks.py) runs `run_updates` on every rank with the same groups: each rank takes its
`share` of every update's micro-batches, the divisors stay the update's global counts, and `sum_stats`
adds the statistics up over the ranks. One rank takes them all (`ALONE`).

The loss is chosen once by name from the registry (`policy_loss`); nothing here branches on it.
"""

from __future__ import annotations

import functools
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol, TypeVar

import deepspeed
import torch
from torch import Tensor, nn

from sparkrl.proto import TrajectoryGroup
from sparkrl.services.common.losses import LossInputs, loss_spec, policy_loss
from sparkrl.services.common.losses.mismatch import Correction, correction_weights
from sparkrl.services.common.settings import LearnerSettings
from sparkrl.services.learner import logprobs
from sparkrl.services.learner.aggregation import aggregation_weights, sequences
from sparkrl.services.learner.batch import (
    MicroBatch,
    Sample,
    Totals,
    micro_batches,
    partition,
    samples_from_groups,
    skipped_micro_batches,
    update_micro_batches,
    work_done,
)
from sparkrl.services.learner.dynamic_sampling import out_of_loss
from sparkrl.services.learner.prompt_sharing import collator
from sparkrl.services.learner.proxy import proxy_logp_from_topk
from sparkrl.services.learner.reference import kl_to_reference
from sparkrl.services.learner.schedule import lr_factor
from sparkrl.services.learner.stats import NotApplied, Stats, Updated, add_mismatch, is_count, merge

T = TypeVar("T")


class Share(Protocol):
    """How an update's micro-batches are split over the learner's ranks (ranks.py's `Ranks`)."""

    def share(self, micro: list[MicroBatch]) -> list[MicroBatch]:
        """This rank's micro-batches of the update (padded so that every rank runs as many)."""
        ...

    def sum_stats(self, stats: Stats) -> Stats:
        """The update's statistics over every rank."""
        ...


class _Alone:
    """One rank: every micro-batch is its own, its statistics are the update's."""

    def share(self, micro: list[MicroBatch]) -> list[MicroBatch]:
        return micro

    def sum_stats(self, stats: Stats) -> Stats:
        return stats


ALONE: Share = _Alone()


def run_updates(
    engine: deepspeed.DeepSpeedEngine,
    groups: list[TrajectoryGroup],
    cfg: LearnerSettings,
    pad_id: int,
    step: int,
    reference: nn.Module | None = None,
    ranks: Share = ALONE,
) -> Updated:
    """The step's updates on `groups` (`step`: the one being taken, 1-based, for the lr schedule): their
    statistics merged over the updates applied, the seconds by part summed over them, and the update that
    was not applied, if one was not (the later ones are then not taken)."""
    started = time.perf_counter()
    adv = cfg.advantage
    kept = [g for g in groups if not out_of_loss(g, cfg)]
    # Advantages over the whole step (a batch-level std is the step's), then cut at group boundaries.
    samples = samples_from_groups(kept, std_normalize=adv.std_normalize, level=adv.level)
    extra = {"equal_groups_dropped": float(len(groups) - len(kept))}
    extra["truncated_masked"] = float(cfg.mask_truncated_completions and sum(s.truncated for s in samples))
    per_update = [m for m in mini_batches(samples, kept, cfg) if m]
    # The divisors count every token, those of completions left unrun for A = 0 included.
    totals = [Totals(sum(s.num_tokens for s in m), sum(s.num_tokens > 0 for s in m)) for m in per_update]
    updates = [partition(m, cfg.micro_batch_tokens) for m in per_update]
    skip = loss_spec(cfg.loss.name).zero_advantage_free and cfg.skip_zero_advantage and reference is None
    collate_fn = collator(pad_id, cfg.pack_length, cfg.share_prompts)
    every = [update_micro_batches(u, collate_fn, skip) for u in updates]
    if skip:
        runs = [sum(mb.num_tokens for mb in mbs) for mbs in every]
        totals = [t._replace(trained=run) for t, run in zip(totals, runs, strict=True)]
    extra |= work_done(every, totals)
    minis = [[mb.to(engine.device) for mb in ranks.share(mbs)] for mbs in every]
    left_out = (  # the skipped completions, for their entropy only (learner.entropy_of_skipped)
        [[mb.to(engine.device) for mb in ranks.share(skipped_micro_batches(u, collate_fn))]
         for u in updates]
        if skip and cfg.entropy_of_skipped
        else []
    )  # fmt: skip
    collated = time.perf_counter()
    engine.eval()  # π_old: every micro-batch of every update, before the first one changes the weights
    olds = [[old_policy(engine.module, mb, cfg, reference) for mb in micro] for micro in minis]
    measured = time.perf_counter()
    with autocast(cfg):
        skipped_entropy = [logprobs.entropy_sum(engine.module, micro) for micro in left_out]
    engine.train()
    seconds = {"collate": collated - started, "old_policy": measured - collated}
    if left_out:
        seconds["entropy_of_skipped"] = time.perf_counter() - measured
    set_lr(engine, cfg.lr * lr_factor(step, cfg.schedule, cfg.max_steps))  # the one place the lr is set
    if not minis:  # every group had equal rewards and was left out: nothing to learn from
        return Updated(extra | {"tokens": 0.0}, seconds, applied=0)
    norm = max(g.sampling.max_new_tokens for g in kept)  # Dr. GRPO's constant length
    applied: list[Stats] = []
    for index, (micro, old, total) in enumerate(zip(minis, olds, totals, strict=True)):
        stats, parts, was_applied = apply_update(engine, micro, old, cfg, total, norm)
        if skipped_entropy:  # the mean over the tokens run becomes the mean over all of the update's
            run = max(total.tokens if total.trained is None else total.trained, 1)
            stats["entropy"] = (stats["entropy"] * run + skipped_entropy[index]) / max(total.tokens, 1)
        stats = ranks.sum_stats(stats)  # every rank applies or skips alike (`apply_gradients`)
        for part, spent in parts.items():
            seconds[part] = seconds.get(part, 0.0) + spent
        if not was_applied:
            # The later updates are not taken either, so what was applied is a prefix of the step's
            # groups (`split_applied`) and the rest can go back whole.
            skipped = NotApplied(loss=stats["loss"], grad_norm=stats["grad_norm"])
            return Updated(merge(applied) | extra, seconds, len(applied), skipped)
        applied.append(stats)
    return Updated(merge(applied) | extra, seconds, len(applied))


def set_lr(engine: deepspeed.DeepSpeedEngine, lr: float) -> None:
    # DeepSpeed's optimizers (ZeRO, bf16) promote the torch optimizer's param_groups for exactly this.
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


def mini_batches(
    samples: list[Sample], groups: list[TrajectoryGroup], cfg: LearnerSettings
) -> list[list[Sample]]:
    """`samples` (the groups' completions, in order) cut into one mini-batch per update; with
    `learner.mask_truncated_completions`, without those that hit max_new_tokens (out of the loss and its
    divisor; their group's advantages were computed with them)."""
    minis = []
    for part in split_groups(groups, cfg.updates_per_rollout):
        count = sum(len(group.completions) for group in part)
        minis.append([s for s in samples[:count] if not (cfg.mask_truncated_completions and s.truncated)])
        samples = samples[count:]
    return minis


def apply_update(
    engine: deepspeed.DeepSpeedEngine,
    micro: list[MicroBatch],
    olds: list[OldPolicy],
    cfg: LearnerSettings,
    totals: Totals | None = None,
    norm_length: int | None = None,
) -> tuple[Stats, Stats, bool]:
    """One update: forward/backward every micro-batch, then the optimizer step. Returns (its statistics,
    the seconds of `forward_backward` and `optimizer`, whether it was applied: not when its loss or
    gradient norm is not finite). `totals`: the update's counts when `micro` is this
    rank's share of it (a data-parallel learner: each rank's loss is then scaled by the DP size, which
    DeepSpeed's gradient averaging divides out again) or lacks its A = 0 rows. `norm_length`: Dr. GRPO's
    constant."""
    started = time.perf_counter()
    if totals is None:
        totals = Totals(sum(mb.num_tokens for mb in micro), sum(sequences(mb.mask) for mb in micro))
    total_tokens = max(totals.tokens, 1)
    # Statistics are means over the tokens run; the loss is the mean over all of them.
    trained_tokens = max(totals.tokens if totals.trained is None else totals.trained, 1)
    dp_size = engine.dp_world_size
    sums: Stats = defaultdict(float)
    sums["loss"] = 0.0
    entropy_grad = loss_spec(cfg.loss.name).entropy_gradient
    for index, (mb, old) in enumerate(zip(micro, olds, strict=True)):
        engine.set_gradient_accumulation_boundary(index == len(micro) - 1)
        if mb.num_tokens == 0:  # a rank's padding (ranks.py): the pass every rank runs, contributing 0
            with autocast(cfg):
                logp, _ = logprobs.token_logp_and_entropy(engine, mb, entropy_grad)
            engine.backward(logp.sum() * 0.0, scale_wrt_gas=False)
            continue
        loss, stats, entropy = micro_batch_loss(
            engine, mb, old, cfg, (total_tokens, totals.sequences), norm_length, entropy_grad
        )
        share = mb.num_tokens / total_tokens
        weight = mb.num_tokens / trained_tokens
        # A non-finite loss goes backward as NaN (a tensor op: no GPU sync here), so its gradient is
        # non-finite for certain, on every rank once reduced, and `apply_gradients` drops the update.
        scale = torch.where(torch.isfinite(loss.detach()), share * dp_size, float("nan"))
        engine.backward(loss * scale, scale_wrt_gas=False)
        sums["loss"] += float(loss.detach()) * share
        sums["entropy"] += float((entropy.detach() * mb.mask).sum()) / trained_tokens
        sums["proxy_inexact"] += old.proxy_inexact
        if old.tis is not None:  # how much IS corrected (capped, masked) the rollout engine's numbers
            add_mismatch(sums, old.tis, weight)
        for key, value in stats.items():
            if key != "entropy":  # measured above over every token; entropy_bonus reports its own copy
                sums[key] += float(value) * (1.0 if is_count(key) else weight)
    stepped = time.perf_counter()
    sums["grad_norm"], applied = apply_gradients(engine)
    sums["tokens"] = float(total_tokens)
    seconds = {"forward_backward": stepped - started, "optimizer": time.perf_counter() - stepped}
    return dict(sums), seconds, applied


@dataclass(frozen=True)
class OldPolicy:
    """What the loss needs from π_old for one micro-batch, all [B, L-1]."""

    old_logp: Tensor
    proxy_logp: Tensor
    is_weights: Tensor | None
    proxy_inexact: int  # positions where the top-k proxy is only approximate
    ref_logp: Tensor | None = None  # the frozen reference's log-probs (learner.kl), else None
    tis: dict[str, float] | None = None  # the mismatch correction's statistics (a recomputed π_old)


@torch.no_grad()
def old_policy(
    model: nn.Module, mb: MicroBatch, cfg: LearnerSettings, reference: nn.Module | None = None
) -> OldPolicy:
    """old_logp and the Lp-Reg proxy, from the rollout's numbers or from a pass of the current weights
    (before this step's first update, so they are π_old for the step); with a `reference`, its log-probs."""
    need_pass = cfg.old_logp_source == "recompute" or cfg.proxy_source == "logits"
    learner_logp, proxy = (None, None)
    if need_pass:
        kappa = cfg.proxy_kappa if cfg.proxy_source == "logits" else None
        with autocast(cfg):  # one pass for both, a chunk of positions at a time (logprobs.py)
            learner_logp, proxy = logprobs.old_logp_and_proxy(model, mb, kappa)
    targets = mb.input_ids[:, 1:]
    if cfg.proxy_source == "logits":
        inexact = 0
    else:
        proxy, exact = proxy_logp_from_topk(targets, mb.topk_ids, mb.topk_logp, kappa=cfg.proxy_kappa)
        inexact = int((mb.mask & ~exact).sum())
    is_weights, tis = None, None
    if cfg.old_logp_source == "recompute":
        old_logp = learner_logp
        correction = Correction(cfg.tis_cap, cfg.tis_level, cfg.is_mask, cfg.is_mask_low, cfg.is_mask_high)
        is_weights, tis = correction_weights(learner_logp, mb.rollout_logp, mb.mask, correction)
    else:
        old_logp = mb.rollout_logp
    ref_logp = None
    if reference is not None:
        with autocast(cfg):
            ref_logp = logprobs.old_logp_and_proxy(reference, mb, kappa=None)[0]
    return OldPolicy(old_logp, proxy, is_weights, inexact, ref_logp, tis)


def micro_batch_loss(
    model: nn.Module,
    mb: MicroBatch,
    old: OldPolicy,
    cfg: LearnerSettings,
    totals: tuple[int, int],
    norm_length: int | None = None,
    entropy_grad: bool = True,
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """One micro-batch's (loss, the loss's statistics, entropy [B, L-1]): the registry's policy loss on its
    tokens, re-weighted for `learner.loss_aggregation` against the update's `totals` (tokens, sequences),
    plus the KL term when a reference is loaded."""
    with autocast(cfg):
        logp, entropy = logprobs.token_logp_and_entropy(model, mb, entropy_grad)
    weights = aggregation_weights(mb.mask, cfg.loss_aggregation, totals[0], totals[1], norm_length)
    if weights is not None:
        weights = weights.to(mb.mask.device)
        weights = weights if old.is_weights is None else weights * old.is_weights
    inputs = LossInputs(
        logp=logp,
        old_logp=old.old_logp,
        advantages=mb.advantages,
        mask=mb.mask,
        proxy_logp=old.proxy_logp,
        entropy=entropy,
        token_weights=old.is_weights if weights is None else weights,
    )
    loss, stats = policy_loss(inputs, cfg.loss)
    if old.ref_logp is not None and cfg.kl.coef > 0:
        kl = kl_to_reference(logp, old.ref_logp, cfg.kl.estimator)
        kl_mean = (kl * mb.mask).sum() / mb.mask.sum().clamp(min=1)
        loss = loss + cfg.kl.coef * kl_mean
        stats = {**stats, "kl_ref": kl_mean.detach()}
    return loss, stats, entropy


def apply_gradients(engine: deepspeed.DeepSpeedEngine) -> tuple[float, bool]:
    """The optimizer step, unless the gradient norm is not finite: (pre-clip norm, whether it was applied).

    ZeRO's optimizers and DeepSpeed's bf16 one measure the norm and drop such a step themselves (its
    gradients cleared, `engine.skipped_steps` counted, the same on every rank). The plain torch optimizer
    of ZeRO stage 0 in float32 would apply NaN, and DeepSpeed clips its gradients and drops the norm, so
    here it is measured first and a non-finite update is dropped by hand: the gradients of every rank are
    the all-reduced ones by now, so every rank decides alike."""
    if engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled():
        engine.step()
        norm = engine.get_global_grad_norm()
        return (float(norm) if norm is not None else float("nan")), engine.was_step_applied()
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
    if not math.isfinite(norm):
        engine.zero_grad()
        return norm, False
    engine.step()
    return norm, True


def autocast(cfg: LearnerSettings) -> torch.autocast:
    """The forward's precision: bf16 matmuls under `learner.autocast`, float32 otherwise."""
    device = "cpu" if cfg.device == "cpu" else "cuda"
    return torch.autocast(device, dtype=torch.bfloat16, enabled=_bf16_autocast(cfg.autocast, device))


@functools.cache
def _bf16_autocast(setting: str, device: str) -> bool:
    if setting != "auto":
        return setting == "bfloat16"
    if device == "cpu":  # without native bf16 (AVX512-BF16, AMX), autocast would only emulate it: slower
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def split_groups(groups: list[T], parts: int) -> list[list[T]]:
    """`groups` in `parts` contiguous runs of near-equal size (fewer when there are fewer groups)."""
    parts = max(1, min(parts, len(groups)))
    bounds = [round(i * len(groups) / parts) for i in range(parts + 1)]
    return [groups[bounds[i] : bounds[i + 1]] for i in range(parts)]


def split_applied(
    groups: list[TrajectoryGroup], cfg: LearnerSettings, updates: int
) -> tuple[list[int], list[int]]:
    """Indexes into `groups`: (those the first `updates` updates of `run_updates` trained, the rest). Groups
    left out for equal rewards need no update: they go with the trained part, if any."""
    kept = [i for i, g in enumerate(groups) if not out_of_loss(g, cfg)]
    if updates == 0:
        return [], list(range(len(groups)))
    parts = split_groups(kept, cfg.updates_per_rollout)
    left = {i for part in parts[updates:] for i in part}
    return [i for i in range(len(groups)) if i not in left], sorted(left)


@torch.no_grad()
def loss_is_finite(
    engine: deepspeed.DeepSpeedEngine,
    groups: list[TrajectoryGroup],
    cfg: LearnerSettings,
    pad_id: int,
    reference: nn.Module | None = None,
) -> bool:
    """Whether `groups` alone give a finite loss under the current weights (nothing is updated): tells a
    group whose numbers overflow the loss (rollout log-probs far out of range) from a model that
    overflows on any group. One rank only: under ZeRO-3 across ranks the forward is a collective."""
    adv = cfg.advantage
    samples = samples_from_groups(groups, std_normalize=adv.std_normalize, level=adv.level)
    micro = [mb.to(engine.device) for mb in micro_batches(samples, cfg.micro_batch_tokens, pad_id)]
    totals = (sum(mb.num_tokens for mb in micro), sum(sequences(mb.mask) for mb in micro))
    norm = max((g.sampling.max_new_tokens for g in groups), default=None)
    engine.eval()
    try:
        for mb in micro:
            old = old_policy(engine.module, mb, cfg, reference)
            loss, _, _ = micro_batch_loss(engine.module, mb, old, cfg, totals, norm, entropy_grad=False)
            if not math.isfinite(float(loss)):
                return False
    finally:
        engine.train()
    return True
