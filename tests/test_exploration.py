"""Exploration telemetry on a hand-built group whose every count is known."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from sparkrl.proto import RewardResult
from sparkrl.proto.testing import random_group
from sparkrl.services.learner.exploration import exploration_stats, spark_tokens

# Per completion: (sampled-token probabilities, correct?, text). The most likely token has p = 0.9 at every
# position, so the min-p cut at κ = 0.02 is p < 0.018.
COMPLETIONS = [
    ([0.5, 0.05, 0.01, 0.9, 0.2], True, "3*8"),  # 2 low (0.05, 0.01), 1 below the cut (0.01)
    ([0.05] * 5, False, "3+8"),  # 5 low, none below the cut, not correct: no sparks
    ([0.5] * 5, True, "24"),  # nothing low
    ([0.001, 0.5, 0.5, 0.5, 0.5], True, " 3*8 "),  # 1 low, 1 below the cut; the same answer as the first
]


def test_the_counts_of_a_hand_built_group() -> None:
    group = random_group(np.random.default_rng(0), n=4, T=5, k=8, vocab_size=260)
    completions, rewards, details = [], [], []
    for completion, (probs, correct, text) in zip(group.completions, COMPLETIONS, strict=True):
        topk = completion.topk_logprobs.copy()
        topk[:, 0] = math.log(0.9)
        logprobs = np.log(np.array(probs, dtype=np.float32))
        completions.append(
            completion.model_copy(update={"logprobs": logprobs, "topk_logprobs": topk, "text": text})
        )
        rewards.append(1.0 if correct else 0.0)
        details.append(
            RewardResult(score=rewards[-1], status="correct" if correct else "incorrect", elapsed_s=0.0)
        )
    group = group.model_copy(
        update={"completions": completions, "rewards": rewards, "reward_details": details}
    )

    stats = exploration_stats([group], kappa=0.02)

    assert stats["explore/sparks"] == 3  # low-probability tokens in correct responses: 2 + 0 + 1
    assert stats["explore/low_prob_share"] == pytest.approx(8 / 20)
    assert stats["explore/below_minp_share"] == pytest.approx(2 / 20)
    assert stats["explore/distinct_correct"] == 2  # "3*8" twice (stripped), "24"
    assert exploration_stats([], kappa=0.02)["explore/sparks"] == 0

    # By token id: exactly the three sparks (completion 0 at positions 1 and 2, completion 3 at 0).
    ids = [c.token_ids for c in group.completions]
    assert spark_tokens([group]) == Counter([int(ids[0][1]), int(ids[0][2]), int(ids[3][0])])
    assert sum(spark_tokens([group]).values()) == stats["explore/sparks"]
