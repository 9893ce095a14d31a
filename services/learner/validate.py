"""The checks a trajectory group must pass before the learner trains on it, against the learner's own model.

The codec already proved a group well-formed (shapes agree, ids below the group's own `vocab_size`,
log-probs finite). What it cannot know is whether the group fits *this* model: a group from another
model (its own vocabulary), one longer than the model's context, or one without the top-k the proxy
reads would crash a step, and, redelivered, crash every restart. Such a group is dead-lettered alone,
with the reason, before it joins a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkrl.proto import TrajectoryGroup
from sparkrl.services.common.settings import LearnerSettings


@dataclass(frozen=True)
class ModelLimits:
    """What the learner's model accepts."""

    vocab_size: int  # the logits' last dimension: every id must be below it
    max_len: int | None  # positions the model can attend over (prompt + completion); None: unknown
    needs_topk: bool  # learner.proxy_source == "topk": every group must carry K ≥ 1

    @classmethod
    def of(cls, model: torch.nn.Module, cfg: LearnerSettings) -> ModelLimits:
        config = getattr(model, "config", None)
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        vocab = getattr(config, "vocab_size", None) or (embeddings.num_embeddings if embeddings else 0)
        max_len = getattr(config, "max_position_embeddings", None)
        return cls(
            vocab_size=int(vocab),
            max_len=int(max_len) if max_len else None,
            needs_topk=cfg.proxy_source == "topk",
        )


def group_problem(group: TrajectoryGroup, limits: ModelLimits) -> str | None:
    """Why the learner cannot train on `group` (a dead-letter reason), or None."""
    if group.vocab_size != limits.vocab_size:
        return (
            f"declares vocab_size {group.vocab_size}, the learner's model has {limits.vocab_size}: sampled "
            "by another model? (every service must load the same `model`)"
        )
    highest = max(
        [int(group.prompt_token_ids.max())]
        + [int(c.token_ids.max()) for c in group.completions if c.num_tokens]
    )
    if highest >= limits.vocab_size:
        return f"token id {highest} is outside the model's vocabulary of {limits.vocab_size}"
    longest = len(group.prompt_token_ids) + max(c.num_tokens for c in group.completions)
    if limits.max_len is not None and longest > limits.max_len:
        return f"a sequence of {longest} tokens exceeds the model's context of {limits.max_len} positions"
    if limits.needs_topk and group.topk < 1:
        return (
            "carries no top-k log-probs, which learner.proxy_source=topk reads (or set proxy_source=logits)"
        )
    return None
