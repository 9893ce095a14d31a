"""The reward service's settings: the `reward` section — its verifiers, an LLM judge (`reward.judge`), a
reward model (`reward.model`) and tasks that mix them (`reward.mixes`); re-exported by `settings.py`.
docs/rewards.md is the user's page."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from sparkrl.services.common.settings.section import Section

# The task names the service scores besides its rule verifiers: the judge's and the reward model's.
JUDGE_TASK = "judge"
REWARD_MODEL_TASK = "reward_model"
TASK_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")

DEFAULT_RUBRIC = (
    "You grade an answer to a question. Question:\n{question}\n\nReference answer:\n{reference}\n\n"
    "Answer to grade:\n{completion}\n\nHow good is the answer, from 0 (wrong) to 10 (fully right)? "
    "End your reply with the grade alone, as a number."
)


class JudgeSettings(Section):
    """An LLM judge behind an OpenAI-compatible endpoint (docs/rewards.md): with a `url`, the reward service
    scores `task: judge` items by it (services/reward/judge.py)."""

    url: str | None = Field(
        None, description="The endpoint's base URL, e.g. http://127.0.0.1:8400/v1 (a `vllm serve`)."
    )
    model: str = Field("judge", min_length=1, description="The model name the endpoint serves.")
    api_key_env: str | None = Field(
        None, description="An environment variable holding the API key (never logged or shown)."
    )
    api_key_file: str | None = Field(
        None, description="A file holding the API key (wins over api_key_env; never logged or shown)."
    )
    rubric: str = Field(
        DEFAULT_RUBRIC,
        min_length=1,
        description="The user message: {question} (the item's task_data.question), {reference} (its answer, "
        "or '(none)') and {completion} are filled in.",
    )
    parse: Literal["number", "labels", "boxed"] = Field(
        "number",
        description="How the reply becomes a score: the last number on `score_range`, the first of "
        "`labels` it names, or the last \\boxed{} (a number or a label).",
    )
    score_range: tuple[float, float] = Field((0.0, 10.0), description="The number scale, mapped to [0, 1].")
    labels: dict[str, float] = Field(
        default_factory=lambda: {"correct": 1.0, "incorrect": 0.0},
        description="Label → score in [0, 1], for parse labels (and boxed labels).",
    )
    pass_score: float = Field(
        1.0, ge=0, le=1, description="A score at or above it is `correct`, below `incorrect`."
    )
    temperature: float = Field(0.0, ge=0, le=10, description="The judge's sampling temperature.")
    max_tokens: int = Field(256, ge=1, le=131_072, description="The judge's reply, tokens at most.")
    concurrency: int = Field(8, ge=1, le=1024, description="Judge calls in flight at once.")
    deadline_s: float = Field(60.0, gt=0, le=3600, description="One item's budget, retries included.")
    retries: int = Field(3, ge=0, le=20, description="Retries of a 429, a 5xx or a failed connection.")
    backoff_s: float = Field(0.5, gt=0, le=60, description="The first retry's pause; doubled each retry.")
    serve: str | None = Field(
        None,
        description="A model folder (Hugging Face format) `sparkrl up` serves as the judge with `vllm serve` "
        "from `serve_python` on loopback, `url` then pointing at it: a local judge.",
    )
    serve_python: str = Field(
        ".venv-vllm/bin/python", description="The interpreter with vLLM that serves a local judge."
    )
    serve_port: int = Field(8400, ge=1, le=65535, description="The local judge's port on 127.0.0.1.")
    serve_args: list[str] = Field(
        default_factory=list,
        description="More `vllm serve` arguments for the local judge, e.g. --chat-template FILE.",
    )
    cache_items: int = Field(
        100_000, ge=0, description="Judged items kept (same rubric as filled: judged once)."
    )

    @model_validator(mode="after")
    def _scale(self) -> JudgeSettings:
        low, high = self.score_range
        if not low < high:
            raise ValueError(
                f"reward.judge.score_range {self.score_range}: the low end must be below the high"
            )
        if any(not 0 <= v <= 1 for v in self.labels.values()):
            raise ValueError("reward.judge.labels: every score must be within [0, 1]")
        return self


class RewardModelSettings(Section):
    """A reward model (a sequence classifier in Hugging Face format) the service runs itself: with a `path`,
    `task: reward_model` items are scored by its forward pass (services/reward/reward_model.py)."""

    path: str | None = Field(
        None, description="The classifier's folder (AutoModelForSequenceClassification)."
    )
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="Where it runs: cpu or cuda[:N].")
    batch_size: int = Field(16, ge=1, le=4096, description="Items in one forward pass.")
    max_length: int = Field(
        2048, ge=8, le=1_048_576, description="Tokens of one item at most (cut from the left)."
    )
    score: Literal["sigmoid", "raw"] = Field(
        "sigmoid",
        description="One logit → sigmoid (a score in [0, 1]) or the raw logit; two labels → label 1's "
        "probability either way.",
    )
    pass_score: float = Field(0.5, description="A score at or above it is `correct`, below `incorrect`.")


class MixPart(Section):
    """One verifier of a mixed task, and its weight."""

    verifier: str = Field(
        pattern=TASK_NAME.pattern,
        description="A task the service scores: a rule verifier (math, countdown, exact, your own), "
        "`judge` or `reward_model`.",
    )
    weight: float = Field(1.0, gt=0, le=1e6, description="Its share in `combine: weighted`.")


class MixSettings(Section):
    """A task scored by several verifiers (docs/rewards.md): `weighted`: the weighted mean of the parts'
    scores (a part that fails — timeout, error, unparseable — makes the item that failure); `fallback`:
    the first part that finds an answer decides (e.g. the rule, then the judge where it says `no_answer`)."""

    combine: Literal["weighted", "fallback"] = Field(
        "weighted", description="How the parts' results combine."
    )
    parts: list[MixPart] = Field(min_length=1, max_length=8, description="The verifiers, in order.")
    pass_score: float = Field(
        1.0, ge=0, le=1, description="weighted: a mean at or above it is `correct`, below `incorrect`."
    )

    @model_validator(mode="after")
    def _distinct(self) -> MixSettings:
        names = [part.verifier for part in self.parts]
        if len(set(names)) != len(names):
            raise ValueError(f"a mix names a verifier twice: {names}")
        return self


class RewardSettings(Section):
    """The reward service (server side) and how clients reach it."""

    host: str = Field("127.0.0.1", description="Interface the service binds.")
    port: int = Field(8100, ge=0, le=65535, description="Port the service binds (0: any free port).")
    url: str = Field("http://127.0.0.1:8100", description="Base URL clients (rollout workers) call.")
    item_timeout_s: float = Field(5.0, gt=0, le=600, description="Default per-item verification time limit.")
    max_item_timeout_s: float = Field(
        30.0, gt=0, le=600, description="Cap on the per-item limit a client may ask for (`timeout_s`)."
    )
    max_request_seconds: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="Budget of one request: items not finished within it score 0 with `timeout`, so no "
        "request holds the pool longer.",
    )
    verifier_processes: int = Field(2, ge=1, le=64, description="Processes in the verification pool.")
    max_request_bytes: int = Field(16 << 20, ge=1024, description="Larger request bodies get 413.")
    custom_verifiers: list[str] = Field(
        default_factory=list,
        description="Extra verifiers as `module:function` import paths, registered under the function name.",
    )
    judge: JudgeSettings = Field(
        default_factory=JudgeSettings,
        description="An LLM judge for `task: judge` items (services/reward/judge.py); off without a url.",
    )
    model: RewardModelSettings = Field(
        default_factory=RewardModelSettings,
        description="A reward model for `task: reward_model` items (services/reward/reward_model.py); off "
        "without a path.",
    )
    mixes: dict[str, MixSettings] = Field(
        default_factory=dict,
        description="Tasks scored by several verifiers, by task name (e.g. `math_judged`: math, then the "
        "judge where it finds no answer).",
    )

    @field_validator("mixes")
    @classmethod
    def _mix_names(cls, mixes: dict[str, MixSettings]) -> dict[str, MixSettings]:
        for name, mix in mixes.items():
            if not TASK_NAME.fullmatch(name):
                raise ValueError(f"reward.mixes: {name!r} is not a task name ([a-z][a-z0-9_]*, 64 at most)")
            if any(part.verifier in mixes for part in mix.parts):
                raise ValueError(f"reward.mixes.{name}: a part names another mix (mix verifiers, not mixes)")
        return mixes
