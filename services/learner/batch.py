"""From trajectory groups to padded micro-batches of per-token tensors.

Layout: each row is prompt + completion, right-padded to the micro-batch's longest row, L tokens. The
model's logits at position j predict token j+1, so every per-token tensor is [B, L-1] and indexed by the
*predicting* position: `mask[b, j]` is True where input_ids[b, j+1] is a generated token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from sparkrl.proto import TrajectoryGroup
from sparkrl.services.learner.advantages import step_advantages


@dataclass(frozen=True)
class Sample:
    """One completion ready to train on."""

    input_ids: Tensor  # [P+T] long: prompt then completion
    prompt_len: int  # P
    rollout_logp: Tensor  # [T] float32, log-prob under the sampling distribution
    topk_ids: Tensor  # [T, K] long
    topk_logp: Tensor  # [T, K] float32
    advantage: float  # GRPO advantage, shared by every token of the completion
    temperature: float  # the sampling temperature; the learner's log-probs are taken at it


@dataclass(frozen=True)
class MicroBatch:
    """Padded tensors of a few samples; per-token tensors are [B, L-1] (see module docstring)."""

    input_ids: Tensor  # [B, L] long
    attention_mask: Tensor  # [B, L] long
    mask: Tensor  # [B, L-1] bool: generated-token targets
    rollout_logp: Tensor  # [B, L-1] float32
    topk_ids: Tensor  # [B, L-1, K] long
    topk_logp: Tensor  # [B, L-1, K] float32
    advantages: Tensor  # [B, L-1] float32
    temperature: Tensor  # [B, 1, 1] float32, divides the logits

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(**{name: getattr(self, name).to(device) for name in self.__dataclass_fields__})


def samples_from_groups(
    groups: list[TrajectoryGroup], eps: float = 1e-6, std_normalize: bool = True, level: str = "group"
) -> list[Sample]:
    """Flatten groups into samples with their advantages (GRPO's by default: normalized within each
    group; see `step_advantages` for the other modes)."""
    samples = []
    rewards = [torch.tensor(group.rewards, dtype=torch.float32) for group in groups]
    for group, advantages in zip(groups, step_advantages(rewards, std_normalize, level, eps), strict=True):
        prompt = torch.from_numpy(group.prompt_token_ids.astype("int64"))
        for completion, advantage in zip(group.completions, advantages.tolist(), strict=True):
            token_ids = torch.from_numpy(completion.token_ids.astype("int64"))
            samples.append(
                Sample(
                    input_ids=torch.cat([prompt, token_ids]),
                    prompt_len=len(prompt),
                    rollout_logp=torch.from_numpy(completion.logprobs.copy()),
                    topk_ids=torch.from_numpy(completion.topk_ids.astype("int64")),
                    topk_logp=torch.from_numpy(completion.topk_logprobs.copy()),
                    advantage=advantage,
                    temperature=group.sampling.temperature,
                )
            )
    return samples


def collate(samples: list[Sample], pad_id: int) -> MicroBatch:
    """Right-pad `samples` into one micro-batch. The per-target tensors are scattered in one indexed copy
    each (not row by row: a step collates hundreds of rows)."""
    B, L = len(samples), max(len(s.input_ids) for s in samples)
    # Groups may carry different top-k widths (workers configured apart): pad to the widest, the padding
    # far below any real log-prob, so it is never in a kept set.
    K = max(s.topk_ids.shape[-1] for s in samples)
    lengths = torch.tensor([len(s.input_ids) for s in samples])
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    input_ids[torch.arange(L) < lengths[:, None]] = torch.cat([s.input_ids for s in samples])
    attention_mask = (torch.arange(L) < lengths[:, None]).long()
    # Generated token i of a row sits at position P+i and is predicted from position P+i-1.
    counts = torch.tensor([len(s.rollout_logp) for s in samples])
    rows = torch.repeat_interleave(torch.arange(B), counts)
    starts = torch.tensor([s.prompt_len - 1 for s in samples])
    cols = torch.repeat_interleave(starts, counts) + _ranks_within(counts)
    mask = torch.zeros(B, L - 1, dtype=torch.bool)
    mask[rows, cols] = True
    rollout_logp = torch.zeros(B, L - 1)
    rollout_logp[rows, cols] = torch.cat([s.rollout_logp for s in samples])
    topk_ids = torch.zeros(B, L - 1, K, dtype=torch.long)
    topk_logp = torch.full((B, L - 1, K), -1e4)  # far below any real log-prob: never in a kept set
    widths = {s.topk_ids.shape[-1] for s in samples}
    if widths == {K}:
        topk_ids[rows, cols] = torch.cat([s.topk_ids for s in samples])
        topk_logp[rows, cols] = torch.cat([s.topk_logp for s in samples])
    else:  # mixed widths: each width's rows in turn
        for k in widths:
            chosen = [i for i, s in enumerate(samples) if s.topk_ids.shape[-1] == k]
            at = torch.isin(rows, torch.tensor(chosen))
            topk_ids[rows[at], cols[at], :k] = torch.cat([samples[i].topk_ids for i in chosen])
            topk_logp[rows[at], cols[at], :k] = torch.cat([samples[i].topk_logp for i in chosen])
    advantages = torch.zeros(B, L - 1)
    advantages[rows, cols] = torch.repeat_interleave(torch.tensor([s.advantage for s in samples]), counts)
    temperature = torch.tensor([s.temperature for s in samples]).view(B, 1, 1)
    return MicroBatch(
        input_ids, attention_mask, mask, rollout_logp, topk_ids, topk_logp, advantages, temperature
    )


def _ranks_within(counts: torch.Tensor) -> torch.Tensor:
    """0, 1, …, counts[0]-1, 0, 1, …, counts[1]-1, …"""
    offsets = torch.cumsum(counts, 0) - counts
    return torch.arange(int(counts.sum())) - torch.repeat_interleave(offsets, counts)


def micro_batches(samples: list[Sample], token_budget: int, pad_id: int) -> list[MicroBatch]:
    """Greedy packing: rows sorted by length, a micro-batch grows while B · L stays within the budget.

    A single row longer than the budget still gets a micro-batch of its own.
    """
    ordered = sorted(samples, key=lambda s: len(s.input_ids))
    batches, current = [], []
    for sample in ordered:
        longest = len(sample.input_ids)  # sorted ascending: the newcomer is the longest row
        if current and (len(current) + 1) * longest > token_budget:
            batches.append(collate(current, pad_id))
            current = []
        current.append(sample)
    if current:
        batches.append(collate(current, pad_id))
    return batches


def empty_like(mb: MicroBatch) -> MicroBatch:
    """A padding micro-batch: the first row's first two tokens and no target — a forward, and a backward
    of zero, that every collective of the pass still sees."""
    return MicroBatch(
        input_ids=mb.input_ids[:1, :2],
        attention_mask=mb.attention_mask[:1, :2],
        mask=torch.zeros_like(mb.mask[:1, :1]),
        rollout_logp=mb.rollout_logp[:1, :1],
        topk_ids=mb.topk_ids[:1, :1],
        topk_logp=mb.topk_logp[:1, :1],
        advantages=torch.zeros_like(mb.advantages[:1, :1]),
        temperature=mb.temperature[:1],
    )


def trained_rows(mb: MicroBatch) -> MicroBatch | None:
    """`mb` without the rows no loss term reaches: a completion whose advantage is 0 (every answer of its
    group scored alike) or that has no token. The rest keep their order and their right padding, cut to
    the longest row kept: the same tensors `collate` makes of them. None when no row is left.

    Only for a loss that is a token mean of terms that vanish where A = 0 and that picks its tokens among
    A ≠ 0 only (losses/registry.py, `skips_zero_advantage`): its gradient is then unchanged, provided the
    caller still divides by every token of the micro-batch, these included (update.py)."""
    keep = ((mb.advantages != 0) & mb.mask).any(dim=-1)
    if bool(keep.all()):
        return mb
    if not bool(keep.any()):
        return None
    length = int(mb.attention_mask[keep].sum(dim=-1).max())
    return MicroBatch(
        input_ids=mb.input_ids[keep, :length],
        attention_mask=mb.attention_mask[keep, :length],
        mask=mb.mask[keep, : length - 1],
        rollout_logp=mb.rollout_logp[keep, : length - 1],
        topk_ids=mb.topk_ids[keep, : length - 1],
        topk_logp=mb.topk_logp[keep, : length - 1],
        advantages=mb.advantages[keep, : length - 1],
        temperature=mb.temperature[keep],
    )


def padded_positions(mb: MicroBatch) -> tuple[int, int]:
    """(positions the forward runs on, those of them padding): B·L and B·L − real tokens."""
    positions = mb.attention_mask.numel()
    return positions, positions - int(mb.attention_mask.sum())


class Totals(NamedTuple):
    """An update's counts, over every rank: its `tokens` and `sequences` (the loss's divisors) and the
    tokens it runs (`trained`; fewer when A = 0 completions are left out). None: the tokens."""

    tokens: int
    sequences: int
    trained: int | None = None


def trained(micro: list[MicroBatch]) -> list[MicroBatch]:
    """An update's micro-batches without their A = 0 rows (`trained_rows`), each micro-batch's remaining
    rows kept together (Lp-Reg's k is counted per micro-batch); one empty pass when nothing is left, so
    the optimizer still steps (Adam moves on a zero gradient too) as it would have."""
    left = [mb for mb in map(trained_rows, micro) if mb is not None]
    return left or [empty_like(micro[0])]


def work_done(every: list[list[MicroBatch]], totals: list[Totals]) -> dict[str, float]:
    """The step's `skipped_tokens` (A = 0 tokens not run) and `padding_share` (of the positions run)."""
    tokens = sum(t.tokens for t in totals)
    run = sum(mb.num_tokens for mbs in every for mb in mbs)
    positions, padding = map(sum, zip(*(padded_positions(mb) for mbs in every for mb in mbs), strict=True))
    return {"skipped_tokens": float(tokens - run), "padding_share": padding / max(positions, 1)}
