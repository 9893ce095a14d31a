"""The learning-rate schedule (`learner.schedule`): a factor of `learner.lr` per optimizer step."""

from __future__ import annotations

import math

from sparkrl.services.common.settings import ScheduleSettings


def lr_factor(step: int, schedule: ScheduleSettings, total_steps: int | None) -> float:
    """The factor for learner step `step` (1-based, the step about to be taken).

    Warm-up: step / warmup_steps for the first `warmup_steps` steps (1/w, 2/w, …, 1). Then constant 1, or a
    decay over the remaining steps to `min_lr_ratio` at `total_steps`: linear (1 − p) or cosine
    (½(1 + cos πp)), p = (step − warmup) / (total − warmup), clamped to [0, 1].
    """
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    warm = schedule.warmup_steps
    if warm and step <= warm:
        return step / warm
    if schedule.kind == "constant":
        return 1.0
    if total_steps is None:
        raise ValueError(f"a {schedule.kind} schedule needs learner.max_steps")
    progress = min(1.0, max(0.0, (step - warm) / max(1, total_steps - warm)))
    decay = 1.0 - progress if schedule.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return schedule.min_lr_ratio + (1.0 - schedule.min_lr_ratio) * decay
