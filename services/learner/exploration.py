"""Exploration telemetry of a step's groups, from what the workers sent: each sampled token's probability
under the sampling policy (`logprobs`), the top-k log-probs (the most likely token's among them) and the
verdicts. What Lp-Reg is meant to protect shows here: rare tokens on the way to correct answers.

- `explore/low_prob_share`: sampled tokens with p < LOW_PROB (0.1), over all sampled tokens.
- `explore/below_minp_share`: sampled tokens below the min-p cut p < κ · p_max — noise by the Lp-Reg
  proxy's definition (κ = learner.proxy_kappa).
- `explore/sparks`: low-probability tokens (p < LOW_PROB) in correct responses, counted.
- `explore/distinct_correct`: distinct correct answers (texts, stripped) per prompt, over the prompts
  with at least one.

`spark_tokens` counts the sparks by token id: the step row carries the most frequent ones, decoded.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from sparkrl.proto import TrajectoryGroup

LOW_PROB = 0.1


def _correct(group: TrajectoryGroup, index: int) -> bool:
    details = group.reward_details
    if details and index < len(details) and details[index] is not None:
        return details[index].status == "correct"
    return group.rewards[index] >= 1.0


def exploration_stats(groups: list[TrajectoryGroup], kappa: float) -> dict[str, float]:
    tokens = low = below_cut = sparks = 0
    distinct: list[int] = []
    log_kappa, log_low = math.log(kappa), math.log(LOW_PROB)
    for group in groups:
        answers = set()
        for index, completion in enumerate(group.completions):
            if not completion.model_tokens:
                continue
            model = completion.model_token_mask()  # an environment's tokens are not the model's choices
            logp = completion.logprobs[model].astype(np.float64)
            is_low = logp < log_low
            tokens += len(logp)
            low += int(is_low.sum())
            below_cut += int((logp < log_kappa + completion.topk_logprobs[model, 0]).sum())
            if _correct(group, index):
                sparks += int(is_low.sum())
                answers.add(completion.text.strip())
        if answers:
            distinct.append(len(answers))
    return {
        "explore/low_prob_share": low / tokens if tokens else 0.0,
        "explore/below_minp_share": below_cut / tokens if tokens else 0.0,
        "explore/sparks": float(sparks),
        "explore/distinct_correct": sum(distinct) / len(distinct) if distinct else 0.0,
    }


def spark_tokens(groups: list[TrajectoryGroup]) -> Counter[int]:
    """Token id → how often it was sampled with p < LOW_PROB in a correct response."""
    counts: Counter[int] = Counter()
    log_low = math.log(LOW_PROB)
    for group in groups:
        for index, completion in enumerate(group.completions):
            if completion.num_tokens and _correct(group, index):
                low = (completion.logprobs.astype(np.float64) < log_low) & completion.model_token_mask()
                counts.update(completion.token_ids[low].tolist())
    return counts
