"""GRPO group-normalized advantages and truncated importance-sampling weights."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from sparkrl.services.learner.advantages import group_advantages, truncated_is_metrics, truncated_is_weights


def test_group_advantages_hand_case_with_unbiased_std() -> None:
    # Group 0: [1, 0, 0], mean 1/3; squared deviations 4/9 + 1/9 + 1/9 = 2/3, unbiased var = (2/3)/2 = 1/3,
    #   std = 0.577350 → A = [ (2/3)/0.57735, −(1/3)/0.57735, −(1/3)/0.57735 ] = [1.154700, −0.577350, …].
    # Group 1: [1, 1, 1] → std 0 → A = 0/(0 + eps) = 0.
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), group_size=3)
    std = math.sqrt(1 / 3) + 1e-6
    assert_close(adv, torch.tensor([(2 / 3) / std, -(1 / 3) / std, -(1 / 3) / std, 0.0, 0.0, 0.0]))


def test_group_advantages_groups_are_contiguous_and_independent() -> None:
    # [0, 2 | 5, 5]: group 0 mean 1, unbiased std √2 → ±1/√2; group 1 constant → 0.
    adv = group_advantages(torch.tensor([0, 2, 5, 5]), group_size=2)  # integer rewards are fine
    assert_close(adv, torch.tensor([-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6), 0.0, 0.0]))


def test_group_of_one_gets_zero_advantage() -> None:
    assert_close(group_advantages(torch.tensor([1.0, 0.0, 3.0]), group_size=1), torch.zeros(3))


@pytest.mark.parametrize("group_size", [0, 4])
def test_rewards_that_do_not_split_into_groups_are_rejected(group_size: int) -> None:
    with pytest.raises(ValueError, match="groups"):
        group_advantages(torch.zeros(6), group_size=group_size)


def test_truncated_is_weights_hand_case() -> None:
    # Token 0: old − rollout = log 0.5 → w = 0.5. Token 1: log 3 → 3 capped to 2.
    # Token 2: masked (and −inf padding) → 0.
    old = torch.tensor([[math.log(0.5), math.log(3.0), -math.inf]])
    rollout = torch.tensor([[0.0, 0.0, -math.inf]])
    mask = torch.tensor([[1, 1, 0]])
    assert_close(truncated_is_weights(old, rollout, mask, cap=2.0), torch.tensor([[0.5, 2.0, 0.0]]))
    stats = truncated_is_metrics(old, rollout, mask, cap=2.0)
    assert stats["capped_tokens"] == 1
    assert_close(stats["capped_frac"], torch.tensor(0.5))
    assert_close(stats["weight_mean"], torch.tensor(1.25))


def test_truncated_is_weights_are_detached_and_never_overflow() -> None:
    old = torch.tensor([[500.0, 0.0]], requires_grad=True)
    w = truncated_is_weights(old, torch.tensor([[-500.0, 0.0]]), torch.ones(1, 2))
    assert not w.requires_grad
    assert_close(w, torch.tensor([[2.0, 1.0]]))
