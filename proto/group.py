"""The trajectory group: one prompt's GRPO group, the unit the learner trains on.

Writer: a rollout worker, after the reward service scored it (published binary, see `codec.py`).
Reader: the learner.
"""

from typing import Any, Literal

from pydantic import Field, ValidationInfo, model_validator

from sparkrl.proto.base import WireModel
from sparkrl.proto.checks import check_ids
from sparkrl.proto.errors import FieldError
from sparkrl.proto.reward import RewardResult
from sparkrl.proto.tensors import Int32Array1D
from sparkrl.proto.trajectory import (
    MAX_VOCAB_SIZE,
    TRAJECTORY_SCHEMA_VERSION,
    Completion,
    Prompt,
    SamplingParams,
    group_id_for,
    is_prechecked,
    prechecked_context,
)


class TrajectoryGroup(WireModel):
    """n completions of one prompt with their rewards. Writer: rollout worker. Reader: learner.

    Invariants: one reward and one reward detail per completion; every completion's top-k has K =
    `topk`; every id (prompt and completions) is below `vocab_size`; `group_id` derives from the
    prompt id; `task` is the prompt's.
    """

    schema_version: Literal[1] = Field(
        default=TRAJECTORY_SCHEMA_VERSION, description="Wire version; readers reject others."
    )
    group_id: str = Field(
        description="`group_id_for(prompt.prompt_id)`, so a replayed prompt delivery publishes the same "
        "id. Writer: rollout worker. Reader: learner (trains on each id once)."
    )
    prompt: Prompt = Field(
        description="The prompt as delivered. Writer: rollout worker (copied from the prompt stream). "
        "Reader: learner (logging, metrics per source)."
    )
    prompt_token_ids: Int32Array1D = Field(
        description="The prompt as tokenized for generation (chat template applied), int32 [P], P ≥ 1. "
        "Writer: rollout worker. Reader: learner (prefix of every sequence)."
    )
    completions: list[Completion] = Field(
        min_length=1,
        description="The GRPO group, n ≥ 1 responses to the same prompt. Writer: rollout worker. Reader: "
        "learner.",
    )
    rewards: list[float] = Field(
        description="Scalar reward of each completion, same order, finite; usually "
        "`reward_details[i].score`, possibly shaped by the worker (then `reward_details[i].score + "
        "overlong_penalties[i]`). Writer: rollout worker. Reader: learner (group-normalized advantages)."
    )
    overlong_penalties: list[float] | None = Field(
        default=None,
        description="The over-long penalty the worker added to each completion's score (DAPO's soft "
        "over-long punishment, `rollout.overlong_buffer`), same order, each in [−penalty_factor, 0]: 0 "
        "up to max_new_tokens − len tokens, then falling linearly to −penalty_factor at max_new_tokens. "
        "Writer: rollout worker. Readers: learner (metrics, samples.jsonl). None: no shaping.",
    )
    resumed_tokens: list[int] | None = Field(
        default=None,
        description="Per completion, same order: how many of its leading tokens were made by another worker "
        "(or an earlier run) that stopped, and continued here from its saved partial work (0: made here "
        "from the prompt). Writer: rollout worker. Reader: learner (rollout/resumed_share). None: nothing "
        "in the group was continued.",
    )
    resumed_from: str | None = Field(
        default=None,
        max_length=128,
        description="The worker whose partial work the group continued. Writer: rollout worker. Readers: "
        "learner, people. None when `resumed_tokens` is.",
    )
    reward_details: list[RewardResult] = Field(
        description="The reward service's result for each completion, same order. Writer: rollout worker "
        "(from the reward service). Reader: learner (metrics: correct / timeout / error rates)."
    )
    task: str = Field(
        min_length=1,
        max_length=64,
        description="Verifier name, equal to `prompt.task`. Writer: rollout worker. Reader: learner "
        "(metrics per task).",
    )
    producer: str = Field(
        min_length=1,
        max_length=128,
        description="Id of the rollout worker that produced the group. Writer: rollout worker. Reader: "
        "learner (metrics, debugging).",
    )
    vocab_size: int = Field(
        gt=0,
        le=MAX_VOCAB_SIZE,
        description="The model's vocabulary size (its logits' last dimension, which may exceed the "
        "tokenizer's); every id is below it. Writer: rollout worker. Reader: learner.",
    )
    topk: int = Field(
        ge=0,
        description="K, the top-k entries recorded per position; 0 when the worker records none (the "
        "learner then builds the Lp-Reg proxy from logits). Writer: rollout worker. Reader: learner.",
    )
    sampling: SamplingParams = Field(
        description="How the completions were sampled. Writer: rollout worker. Reader: learner."
    )
    created_at: float = Field(
        ge=0,
        description="Unix time (s) the worker started generating. Writer: rollout worker. Reader: learner "
        "(latency metrics).",
    )
    scored_at: float = Field(
        ge=0,
        description="Unix time (s) the reward service's answer arrived. Writer: rollout worker. Reader: "
        "learner (latency metrics).",
    )
    published_at: float = Field(
        ge=0,
        description="Unix time (s) the group was published. Writer: rollout worker. Reader: learner "
        "(bus-lag metrics).",
    )

    @property
    def num_tokens(self) -> int:
        """Generated tokens over all completions."""
        return sum(c.num_tokens for c in self.completions)

    @property
    def oldest_policy_version(self) -> int | None:
        """The lowest policy version of any generated token (staleness); None when no token was generated."""
        versions = [int(c.policy_versions.min()) for c in self.completions if c.num_tokens]
        return min(versions) if versions else None

    @classmethod
    def of_made_completions(cls, **fields: Any) -> "TrajectoryGroup":
        """A worker's group, built from completions its engine just made, right before it is encoded: each
        completion's values were scanned by its own validator when it was made, so that scan is not
        repeated here (pydantic re-runs a nested model's validators on an instance); shapes, K, T and the
        group's own fields are checked as always. The ids' bound by `vocab_size` is checked when the group
        is encoded: `encode_group` validates every value it writes, as for any group."""
        return cls.model_validate(fields, context=prechecked_context())

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> "TrajectoryGroup":
        n = len(self.completions)
        for name in ("rewards", "reward_details", "overlong_penalties", "resumed_tokens"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise FieldError(name, f"has {len(getattr(self, name))} entries for {n} completions")
        if any(p > 0 for p in self.overlong_penalties or ()):
            raise FieldError("overlong_penalties", "a penalty is ≤ 0")
        for i, resumed in enumerate(self.resumed_tokens or ()):
            T = self.completions[i].num_tokens
            if not 0 <= resumed <= T:
                raise FieldError(f"resumed_tokens[{i}]", f"must be in [0, T={T}]")
        if self.task != self.prompt.task:
            raise FieldError("task", f"{self.task!r} differs from prompt.task {self.prompt.task!r}")
        expected_id = group_id_for(self.prompt.prompt_id)
        if self.group_id != expected_id:
            raise FieldError("group_id", f"must be group_id_for(prompt.prompt_id) = {expected_id!r}")
        if self.prompt_token_ids.shape[0] == 0:
            raise FieldError("prompt_token_ids", "is empty (P must be ≥ 1)")
        for i, completion in enumerate(self.completions):
            self._check_completion(i, completion, prechecked=is_prechecked(info))
        if not is_prechecked(info):
            check_ids(self.prompt_token_ids, "prompt_token_ids", self.vocab_size)
        return self

    def _check_completion(self, i: int, completion: Completion, prechecked: bool) -> None:
        K = completion.topk_ids.shape[1]
        if K != self.topk:
            raise FieldError(
                f"completions[{i}].topk_ids", f"has K={K} columns, the group's topk is {self.topk}"
            )
        T = max(completion.model_turns(), default=0)  # a multi-turn episode's budget is per model turn
        if T > self.sampling.max_new_tokens:
            what = "a model turn of" if completion.environment_spans else ""
            raise FieldError(
                f"completions[{i}].token_ids",
                f"{what} T={T} exceeds sampling.max_new_tokens={self.sampling.max_new_tokens}".lstrip(),
            )
        if not prechecked:
            # Lower bounds were checked by the completion's own validator; only vocab_size is new here.
            check_ids(completion.token_ids, f"completions[{i}].token_ids", self.vocab_size)
            check_ids(completion.topk_ids, f"completions[{i}].topk_ids", self.vocab_size)
