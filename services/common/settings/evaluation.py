"""The in-training evaluator's settings: the `eval` section; re-exported by `settings.py`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sparkrl.services.common.settings.section import Section


class EvalSettings(Section):
    """Held-out evaluation while training: an evaluator process loads each `every`-th published version
    (from the learner's weight snapshot) and writes an `EvalRecord` to the telemetry and
    `RUN_DIR/eval.jsonl`. The learner never waits for it."""

    every: int | None = Field(
        None,
        ge=1,
        description="Evaluate every N policy versions (and the initial model); None: no evaluator.",
    )
    task: Literal["countdown", "math", "exact"] = Field(
        "countdown",
        description="countdown: the held-out split at prompts.countdown's difficulty; math and exact (the "
        "answer matched as written, e.g. the agent preset's lookup): the problems in `path`.",
    )
    path: str | None = Field(None, description="math, exact: the jsonl/parquet file of held-out problems.")
    prompt_field: str = Field("problem", description="math: the question's field (OlympiadBench: question).")
    answer_field: str = Field("answer", description="math: the answer's field (OlympiadBench: final_answer).")
    problems: int = Field(256, ge=1, description="Problems per evaluation (math: at most the file's rows).")
    n: int = Field(8, ge=1, le=1024, description="Samples per problem; pass@k is reported for k ≤ n.")
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature of the n samples.")
    max_new_tokens: int = Field(24, ge=1, le=131_072, description="Longest answer, tokens.")
    seed: int = Field(0, description="Sampling seed: every evaluation draws the same way.")
    threads: int | None = Field(1, ge=1, description="torch CPU threads of the evaluator (None: all).")
    final: bool = Field(
        True, description="On stop, evaluate the newest version too (the curve's last point)."
    )
    poll_s: float = Field(1.0, gt=0, le=60, description="How often it looks for a newer version.")

    @model_validator(mode="after")
    def _math_has_a_file(self) -> EvalSettings:
        if self.task != "countdown" and self.path is None:
            raise ValueError(f"eval.task {self.task} needs eval.path (a file of held-out problems, e.g. "
                             "math500.jsonl)")  # fmt: skip
        return self
