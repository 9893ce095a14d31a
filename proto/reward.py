"""Reward service messages: a batch of completions to score, and one result per item.

Writer: a rollout worker (`POST /score`). Reader: the reward service, which answers with `RewardResponse`.
"""

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

REWARD_SCHEMA_VERSION = 1
MAX_ITEMS_PER_REQUEST = 4096
MAX_COMPLETION_CHARS = 200_000


class RewardItem(BaseModel):
    """One completion to score."""

    model_config = ConfigDict(extra="forbid")

    task: str = Field(
        min_length=1,
        max_length=64,
        description="Verifier name in the reward service's registry: `math`, `countdown` or a custom one.",
    )
    completion: str = Field(
        max_length=MAX_COMPLETION_CHARS, description="The generated text, decoded, without the prompt."
    )
    answer: str | None = Field(
        default=None,
        max_length=MAX_COMPLETION_CHARS,
        description="Reference answer (e.g. `\\frac{1}{2}` for math). None when the task needs none "
        "(countdown uses `task_data`).",
    )
    task_data: dict[str, Any] | None = Field(
        default=None,
        description='Task-specific data, e.g. countdown\'s `{"numbers": [...], "target": 24}`. '
        "None when the task needs none.",
    )


class RewardRequest(BaseModel):
    """A batch to score. Writer: rollout worker. Reader: reward service."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = Field(
        default=REWARD_SCHEMA_VERSION, description="Wire version; the service rejects others with 422."
    )
    items: list[RewardItem] = Field(
        min_length=1,
        max_length=MAX_ITEMS_PER_REQUEST,
        description="Items scored independently, answered in the same order.",
    )
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=600,
        description="Per-item time limit in seconds; None means the service's default. An item past it "
        "scores 0 with status `timeout`.",
    )


# Every status a result may have, in one place: the service, the learner's counts and the page read it.
RewardStatus = Literal["correct", "incorrect", "no_answer", "timeout", "error", "unparseable"]
REWARD_STATUSES: tuple[str, ...] = get_args(RewardStatus)
# Where scoring failed: the status says nothing of the completion (the worker makes its reward the group's
# scored mean, services/rollout/batch.py `group_rewards`; a mixed task fails with its part).
UNSCORED = frozenset({"timeout", "error", "unparseable"})


class RewardResult(BaseModel):
    """The score of one item. Writer: reward service. Reader: rollout worker (into the trajectory group)."""

    model_config = ConfigDict(extra="forbid")

    score: float = Field(
        description="The reward, usually 0 or 1; 0 for every status but `correct`, unless a custom "
        "verifier gives partial credit."
    )
    status: RewardStatus = Field(
        description="`no_answer`: nothing to check could be extracted; `timeout`: the item ran past its "
        "limit; `error`: the verifier raised (see `detail`); `unparseable`: a judge answered without a "
        "score (its reply is the `detail`)."
    )
    detail: str = Field(
        default="", max_length=2000, description="Human-readable reason: the extracted answer, the error, …"
    )
    elapsed_s: float = Field(ge=0, description="Wall time spent verifying this item, seconds.")


class JudgeUsage(BaseModel):
    """What the LLM judge spent: on one request's items (`RewardResponse.judge`), or a worker's summed since
    it started (`WorkerStatus.judge`, for the live page). Writer: reward service. Readers: rollout worker,
    control service, the page."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    items: dict[RewardStatus, int] = Field(
        default_factory=dict,
        description="Items the judge scored (a mix's judge part included), by status: `correct`, "
        "`incorrect`, and the failures `unparseable`, `timeout`, `error`.",
    )
    calls: int = Field(default=0, ge=0, description="HTTP calls to its endpoint, retries included.")
    cache_hits: int = Field(default=0, ge=0, description="Items answered from its cache, with no call.")
    tokens: int = Field(default=0, ge=0, description="Tokens its endpoint reported spending (`usage`).")
    seconds: float = Field(default=0.0, ge=0, description="Wall time of those items, summed, seconds.")

    def plus(self, other: "JudgeUsage") -> "JudgeUsage":
        """Both, summed."""
        items = dict(self.items)
        for status, count in other.items.items():
            items[status] = items.get(status, 0) + count
        return JudgeUsage(
            items=items,
            calls=self.calls + other.calls,
            cache_hits=self.cache_hits + other.cache_hits,
            tokens=self.tokens + other.tokens,
            seconds=self.seconds + other.seconds,
        )


class RewardResponse(BaseModel):
    """Scores in request order. Writer: reward service. Reader: rollout worker."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = Field(default=REWARD_SCHEMA_VERSION, description="Wire version.")
    results: list[RewardResult] = Field(description="One result per request item, same order.")
    judge: JudgeUsage | None = Field(
        default=None, description="What the LLM judge spent on these items; None when it scored none."
    )
