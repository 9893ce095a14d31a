"""Over-long reward shaping, done in one place: the worker's scoring (`batch.score_groups`), which alone
knows each completion's length in tokens and the budget it was sampled with (the reward service sees
text). DAPO's soft over-long punishment (Yu et al., arXiv 2503.14476, eq. 13), with L_max the budget
(`rollout.sampling.max_new_tokens`) and L_cache the buffer (`rollout.overlong_buffer.len`):

    R_length(|y|) = 0                                   |y| ≤ L_max − L_cache
                  = ((L_max − L_cache) − |y|) / L_cache  L_max − L_cache < |y| ≤ L_max
                  = −1                                   |y| > L_max

times `penalty_factor`, added to the verifier's score. verl's DAPO reward manager
(`reward_model.overlong_buffer`) computes the same ramp; TRL's `get_soft_overlong_punishment` is the case
penalty_factor = 1. A completion never has more than L_max tokens here, so the last case is the ramp's
end. DAPO's other half, masking truncated completions out of the loss, is the learner's
(`learner.mask_truncated_completions`).
"""

from __future__ import annotations

from sparkrl.services.common.settings.rollout import OverlongBufferSettings


def overlong_penalty(tokens: int, max_new_tokens: int, buffer: OverlongBufferSettings) -> float:
    """The penalty (≤ 0) of a completion of `tokens` tokens sampled with a budget of `max_new_tokens`;
    0.0 when shaping is off (`buffer.len` None)."""
    if buffer.len is None:
        return 0.0
    free = max_new_tokens - buffer.len  # the longest completion that costs nothing
    if tokens > max_new_tokens:
        return -buffer.penalty_factor
    return min(0.0, (free - tokens) / buffer.len) * buffer.penalty_factor
