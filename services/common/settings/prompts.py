"""The prompt feeder's settings: the `prompts` section; re-exported by `settings.py`."""

from __future__ import annotations

from pydantic import Field, model_validator

from sparkrl.services.common.settings.reward import TASK_NAME
from sparkrl.services.common.settings.section import Section


class CountdownSettings(Section):
    """The countdown generator's difficulty (the defaults are the tiny model's training distribution)."""

    min_count: int = Field(2, ge=2, le=6, description="Fewest numbers in a problem.")
    max_count: int = Field(3, ge=2, le=6, description="Most numbers in a problem (≥ min_count).")
    max_number: int = Field(9, ge=1, le=1000, description="Largest number given.")
    max_target: int = Field(100, ge=1, le=100000, description="Largest target.")

    @model_validator(mode="after")
    def _counts_in_order(self) -> CountdownSettings:
        if self.min_count > self.max_count:
            raise ValueError(f"min_count {self.min_count} > max_count {self.max_count}")
        return self


class PromptSettings(Section):
    """What `sparkrl prompts` feeds into the prompt stream."""

    task: str = Field(
        "countdown",
        pattern=f"^{TASK_NAME.pattern}$",
        description="The task each prompt names, which the reward service scores it by: countdown "
        "(generated, without a path), math, exact (the answer verbatim), judge (an LLM judge), "
        "reward_model, a mix of reward.mixes or your own verifier; every task but countdown reads "
        "prompts.path.",
    )
    path: str | None = Field(
        None, description="jsonl/parquet file of prompts (math); None: generate (countdown)."
    )
    prompt_field: str = Field("prompt", description="Column holding the question.")
    answer_field: str = Field("answer", description="Column holding the reference answer.")
    count: int | None = Field(None, ge=1, description="How many prompts to feed; None: the whole file / 64.")
    seed: int = Field(0, description="Seed of the countdown generator and of shuffling.")
    countdown: CountdownSettings = Field(
        default_factory=CountdownSettings, description="The countdown generator's difficulty."
    )
    shuffle: bool = Field(False, description="Shuffle the file's rows before feeding.")
    epochs: int = Field(
        1, ge=1, le=10_000, description="Passes over the data; when the last is trained, the run ends."
    )
    template: str = Field(
        "{prompt}",
        description="Text wrapping each question: `{prompt}` is replaced by it, every other character (a "
        "`\\boxed{}` included) is kept as written.",
    )

    @model_validator(mode="after")
    def _template_has_the_prompt(self) -> PromptSettings:
        if "{prompt}" not in self.template:
            raise ValueError(
                f"prompts.template {self.template!r} has no {{prompt}}: where does the question go?"
            )
        return self
