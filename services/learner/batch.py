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
from sparkrl.services.learner.advantages import group_advantages


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


def samples_from_groups(groups: list[TrajectoryGroup], eps: float = 1e-6) -> list[Sample]:
    """Flatten groups into samples with GRPO advantages (normalized within each group)."""
    samples = []
    for group in groups:
        rewards = torch.tensor(group.rewards, dtype=torch.float32)
        advantages = group_advantages(rewards, group_size=len(group.rewards), eps=eps)
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
    """Right-pad `samples` into one micro-batch."""
    B, L = len(samples), max(len(s.input_ids) for s in samples)
    K = samples[0].topk_ids.shape[-1]
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L - 1, dtype=torch.bool)
    rollout_logp = torch.zeros(B, L - 1)
    topk_ids = torch.zeros(B, L - 1, K, dtype=torch.long)
    topk_logp = torch.full((B, L - 1, K), -1e4)  # far below any real log-prob: never in a kept set
    advantages = torch.zeros(B, L - 1)
    for row, s in enumerate(samples):
        n, P = len(s.input_ids), s.prompt_len
        input_ids[row, :n] = s.input_ids
        attention_mask[row, :n] = 1
        # Generated token i sits at position P+i and is predicted from position P+i-1.
        targets = slice(P - 1, n - 1)
        mask[row, targets] = True
        rollout_logp[row, targets] = s.rollout_logp
        topk_ids[row, targets] = s.topk_ids
        topk_logp[row, targets] = s.topk_logp
        advantages[row, targets] = s.advantage
    temperature = torch.tensor([s.temperature for s in samples]).view(B, 1, 1)
    return MicroBatch(
        input_ids, attention_mask, mask, rollout_logp, topk_ids, topk_logp, advantages, temperature
    )


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
