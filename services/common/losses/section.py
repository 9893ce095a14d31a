"""The base of a loss's settings class, and the reasons behind the bounds the losses share.

A loss's settings class (in its own file, beside its function) subclasses `LossSection`, names the loss
with `name: Literal["…"]` (several names may share one class: `ppo_clip` and `grpo`), and holds every
hyperparameter with its default, bounds and description: the function has no defaults of its own. The
settings tree picks the class up as one variant of `learner.loss`, chosen by `name`.

Why each bound is where it is: a live change out of bounds gets a 422 with the reason
(`json_schema_extra["why"]`, keyed by the constraint; settings/hparams.py), so a bounded field says why.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

FRACTION = {"why": {"ge": "it is a fraction of the tokens", "le": "it is a fraction of the tokens"}}
CLIP_LOW = {
    "why": {
        "ge": "a negative ε_low would clip the ratio above 1 on the low side",
        "le": "the ratio's lower clip 1 − ε_low cannot go below 0",
    }
}
CLIP_HIGH = {
    "why": {
        "ge": "a negative ε_high would clip the ratio below 1 on the high side",
        "le": "past a ratio of 101 the clip no longer bounds a step (the paper's Lp-Reg uses 9: ratio ≤ 10)",
    }
}
WEIGHT = {
    "why": {
        "ge": "a negative weight would reward what the term penalizes",
        "le": "a larger weight drowns the policy gradient, and in float32 can overflow it (the papers use 1)",
    }
}


class LossSection(BaseModel):
    """A loss's settings: unknown keys are errors, and the values frozen: a live change is a new value
    (settings/hparams.py), as for the learner's settings that hold it."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)
