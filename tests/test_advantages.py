"""GRPO group-normalized advantages."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from sparkrl.services.learner.advantages import group_advantages


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
