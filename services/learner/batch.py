"""From trajectory groups to padded micro-batches of per-token tensors.

Layout: each row is prompt + completion, right-padded to the micro-batch's longest row, L tokens. The
model's logits at position j predict token j+1, so every per-token tensor is [B, L-1] and indexed by the
*predicting* position: `mask[b, j]` is True where input_ids[b, j+1] is a generated token.
"""

from __future__ import annotations

from dataclasses import dataclass

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
