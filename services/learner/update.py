"""One learner step's update: the step's groups → advantages → π_old (and the KL reference) for every
micro-batch, before any update → `updates_per_rollout` optimizer steps, one per mini-batch, at the
scheduled learning rate.

With one update per rollout (the default) this is one optimizer step over all the step's tokens. With N,
the groups are split into N mini-batches (contiguous, at group boundaries) and each is its own update
against the same π_old: from the second on, the ratio moves off 1 and the loss's clipping is what
keeps the step near π_old (the paper's off-policy setting uses 8). The policy version still advances
once per learner step: the fleet gets one new version per rollout batch.

An update whose loss or gradient norm is not finite is not applied (trainer.py), and the step's later
updates are not taken: the learner commits the groups the applied ones trained (`split_applied`) and
sends the rest back, or dead-letters a group whose loss alone is not finite (`loss_is_finite`).
"""

from __future__ import annotations

import math
import time
from typing import TypeVar

import torch
from deepspeed import DeepSpeedEngine
from torch import nn

from sparkrl.proto import TrajectoryGroup
from sparkrl.services.common.settings import LearnerSettings
from sparkrl.services.learner.aggregation import sequences
from sparkrl.services.learner.batch import Sample, micro_batches, samples_from_groups
from sparkrl.services.learner.control import set_lr
from sparkrl.services.learner.ledger import Batch
from sparkrl.services.learner.ranks import Ranks, empty_like
from sparkrl.services.learner.schedule import lr_factor
from sparkrl.services.learner.trainer import micro_batch_loss, old_policy, train_step

T = TypeVar("T")

# Counts add up over updates.
ADDITIVE = ("reg_tokens", "reg_tokens_pos", "proxy_inexact", "tokens", "tis_capped_tokens")


def _equal_rewards(group: TrajectoryGroup) -> bool:
    return len(set(group.rewards)) <= 1


def split_groups(groups: list[T], parts: int) -> list[list[T]]:
    """`groups` in `parts` contiguous runs of near-equal size (fewer when there are fewer groups)."""
    parts = max(1, min(parts, len(groups)))
    bounds = [round(i * len(groups) / parts) for i in range(parts + 1)]
    return [groups[bounds[i] : bounds[i + 1]] for i in range(parts)]


def compute_update(
    engine: DeepSpeedEngine,
    batch: Batch,
    cfg: LearnerSettings,
    pad_id: int,
    step: int,
    reference: nn.Module | None = None,
    timings: dict[str, float] | None = None,
    ranks: Ranks | None = None,
) -> dict[str, float]:
    """π_old for every micro-batch (before any update), then the step's optimizer steps; `step` is the
    learner step being taken (1-based, for the schedule). `timings` gets the seconds of `collate`,
    `old_policy`, `forward_backward` and `optimizer` (summed over the updates). With `ranks`, every rank
    calls this on the same batch: each takes its share of every update's micro-batches, the divisors
    stay the update's global counts, and the statistics come back summed over the ranks."""
    timings = timings if timings is not None else {}
    started = time.perf_counter()
    adv = cfg.advantage
    groups = [g for g in batch.groups if not (adv.drop_equal_groups and _equal_rewards(g))]
    extra = {"equal_groups_dropped": float(len(batch.groups) - len(groups))}
    # Advantages over the whole step (a batch-level std is the step's), then cut at group boundaries.
    samples = samples_from_groups(groups, std_normalize=adv.std_normalize, level=adv.level)
    minis: list[list[Sample]] = []
    for part in split_groups(groups, cfg.updates_per_rollout):
        count = sum(len(group.completions) for group in part)
        minis.append(samples[:count])
        samples = samples[count:]
    device = engine.device
    every = [micro_batches(m, cfg.micro_batch_tokens, pad_id) for m in minis if m]
    totals = [(sum(mb.num_tokens for mb in mbs), sum(sequences(mb.mask) for mb in mbs)) for mbs in every]
    if ranks is not None:
        every = [ranks.share(mbs, lambda first=mbs[0]: empty_like(first)) for mbs in every]
    batches = [[mb.to(device) for mb in mbs] for mbs in every]
    collated = time.perf_counter()
    engine.eval()
    olds = [[old_policy(engine.module, mb, cfg, reference) for mb in mini] for mini in batches]
    engine.train()
    timings["collate"], timings["old_policy"] = collated - started, time.perf_counter() - collated
    set_lr(engine, cfg.lr * lr_factor(step, cfg.schedule, cfg.max_steps))
    if not batches:  # every group had equal rewards and was left out: nothing to learn from
        return extra | {"tokens": 0.0, "updates": 0.0}
    per_update, skipped = [], {}
    for mini, old, total in zip(batches, olds, totals, strict=True):
        part: dict[str, float] = {}
        norm = max((g.sampling.max_new_tokens for g in groups), default=None)  # Dr. GRPO's constant
        stats = train_step(engine, mini, old, cfg, part, norm, total)
        stats = stats if ranks is None else ranks.sum_stats(stats)  # every rank skips alike (trainer.py)
        for key, seconds in part.items():
            timings[key] = timings.get(key, 0.0) + seconds
        if stats.pop("skipped", 0.0):
            # Not applied: the later updates are not taken either, so what was applied is a prefix of the
            # step's groups (`split_applied`) and the rest can go back whole.
            skipped = {
                "updates_skipped": 1.0,
                "skipped_loss": stats["loss"],
                "skipped_grad_norm": stats["grad_norm"],
            }
            break
        per_update.append(stats)
    return _merge(per_update) | extra | {"updates": float(len(per_update))} | skipped


def split_applied(batch: Batch, cfg: LearnerSettings, updates: int) -> tuple[list[int], list[int]]:
    """Indexes into `batch.groups`: (those the first `updates` updates of `compute_update` trained, the
    rest). Groups left out for equal rewards need no update: they go with the trained part, if any."""
    adv = cfg.advantage
    kept = [i for i, g in enumerate(batch.groups) if not (adv.drop_equal_groups and _equal_rewards(g))]
    if updates == 0:
        return [], list(range(len(batch.groups)))
    parts = split_groups(kept, cfg.updates_per_rollout)
    left = {i for part in parts[updates:] for i in part}
    return [i for i in range(len(batch.groups)) if i not in left], sorted(left)


@torch.no_grad()
def loss_is_finite(
    engine: DeepSpeedEngine,
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
    batches = [mb.to(engine.device) for mb in micro_batches(samples, cfg.micro_batch_tokens, pad_id)]
    totals = (sum(mb.num_tokens for mb in batches), sum(sequences(mb.mask) for mb in batches))
    norm = max((g.sampling.max_new_tokens for g in groups), default=None)
    engine.eval()
    try:
        for mb in batches:
            old = old_policy(engine.module, mb, cfg, reference)
            loss, _, _ = micro_batch_loss(engine.module, mb, old, cfg, totals, norm, entropy_grad=False)
            if not math.isfinite(float(loss)):
                return False
    finally:
        engine.train()
    return True


def _merge(stats: list[dict[str, float]]) -> dict[str, float]:
    """Counts add up over the updates; rates and losses are averaged by token share."""
    total = sum(s.get("tokens", 0.0) for s in stats) or 1.0
    merged: dict[str, float] = {}
    for s in stats:
        weight = s.get("tokens", 0.0) / total
        for key, value in s.items():
            merged[key] = merged.get(key, 0.0) + (value if key in ADDITIVE else value * weight)
    return merged
