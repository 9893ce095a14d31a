"""Per-response advantages (GRPO group normalization). The importance weights against the rollout engine's
numbers are in services/common/losses/mismatch.py.

GRPO's std is the *unbiased* one (Bessel's correction, n − 1), as verl's `compute_grpo_outcome_advantage`
uses `torch.std` — in the Lp-Reg authors' fork as in upstream verl. One deliberate difference: verl gives
a lone response (group of size 1) mean 0 and std 1, i.e. advantage = its raw reward; here it gets 0, since
a group of one carries no relative signal (docs/architecture.md, "A step's update": reward minus group
mean).
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """A_i = (r_i − mean_g r) / (std_g r + eps) per group g of `group_size` contiguous responses.

    rewards [N] with N = groups × group_size → advantages [N] (float32 for integer rewards). std is
    unbiased (n − 1); a group of size 1 gets advantage 0; a group with equal rewards gets 0.
    """
    (N,) = rewards.shape
    if group_size < 1 or N % group_size != 0:
        raise ValueError(f"{N} rewards do not split into groups of {group_size}")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    if group_size == 1:
        return torch.zeros_like(r)
    grouped = r.view(N // group_size, group_size)  # [G, n]
    mean = grouped.mean(dim=-1, keepdim=True)  # [G, 1]
    std = grouped.std(dim=-1, keepdim=True)  # [G, 1], unbiased
    return ((grouped - mean) / (std + eps)).view(N)


def step_advantages(
    group_rewards: list[Tensor], std_normalize: bool = True, level: str = "group", eps: float = 1e-6
) -> list[Tensor]:
    """Advantages of a step's groups (each [n_g]) under `learner.advantage`: reward − group mean, divided
    by the group's std (GRPO, `group_advantages`), by the std of all the step's rewards (`level="batch"`),
    or by nothing (`std_normalize=False`, Dr. GRPO). A group of one gets 0 in every mode."""
    if std_normalize and level == "group":
        return [group_advantages(r, group_size=len(r), eps=eps) for r in group_rewards]
    rewards = [r.to(torch.promote_types(r.dtype, torch.float32)) for r in group_rewards]
    centered = [r - r.mean() if len(r) > 1 else torch.zeros_like(r) for r in rewards]
    if not std_normalize:
        return centered
    every = torch.cat(rewards)
    std = every.std() if len(every) > 1 else torch.tensor(0.0)
    return [c / (std + eps) for c in centered]
