"""Partial work: the group a worker was making when it stopped, for the worker that takes its prompt next.

Writer: a rollout worker that stops mid-generation (a signal, a stop command, scaled down, or dropped out
of a weight broadcast), under `{ns}:value:partial:<group id>` (JSON, `encode_message`), before it releases
the prompt. Reader: the worker that takes the prompt next: it continues the samples cut short instead of
starting them from the prompt, keeps the finished ones, and deletes the record once the group is published.
The prompt delivery is the same (its entry is never acknowledged in between), so is the group id: nothing
is made twice, nothing trained twice.
"""

from typing import Any, Literal

from pydantic import Field, model_validator

from sparkrl.proto.base import WireModel
from sparkrl.proto.environment import EPISODE_ID_PATTERN
from sparkrl.proto.errors import FieldError
from sparkrl.proto.tensors import Int32Array1D
from sparkrl.proto.trajectory import (
    MAX_VOCAB_SIZE,
    ChatMessage,
    Completion,
    Prompt,
    SamplingParams,
    group_id_for,
)

PARTIAL_SCHEMA_VERSION = 1


class PartialGroup(WireModel):
    """A group not finished: every sample as far as it got. Writer: the rollout worker that stopped.
    Reader: the rollout worker that continues it."""

    schema_version: Literal[1] = Field(
        default=PARTIAL_SCHEMA_VERSION, description="Wire version; readers reject others."
    )
    group_id: str = Field(
        description="`group_id_for(prompt.prompt_id)`: the id the finished group is published under. Writer "
        "and reader: rollout workers."
    )
    prompt: Prompt = Field(description="The prompt as delivered. Writer and reader: rollout workers.")
    prompt_token_ids: Int32Array1D = Field(
        description="The prompt as tokenized for generation, int32 [P], P ≥ 1. Reader: the continuing worker "
        "continues only when its own tokenization is the same."
    )
    completions: list[Completion] = Field(
        min_length=1,
        description="The group's n samples in order, each as far as it got: `finish_reason` abort for one "
        "cut short (continued from its last token; T may be 0: not started), stop or length for a finished "
        "one (kept as is). Per-token versions and log-probs are those it was sampled with. Writer: the "
        "stopped worker. Reader: the continuing worker.",
    )
    producer: str = Field(
        min_length=1,
        max_length=128,
        description="The worker that made the tokens so far. Reader: the continuing worker (it names it in "
        "the group it publishes, `TrajectoryGroup.resumed_from`).",
    )
    vocab_size: int = Field(gt=0, le=MAX_VOCAB_SIZE, description="The model's vocabulary size.")
    topk: int = Field(ge=0, description="K, the top-k entries of every position.")
    sampling: SamplingParams = Field(
        description="How the samples were drawn; a worker sampling otherwise starts them afresh."
    )
    saved_at: float = Field(ge=0, description="Unix time (s) the work was saved.")

    @model_validator(mode="after")
    def _check(self) -> "PartialGroup":
        expected_id = group_id_for(self.prompt.prompt_id)
        if self.group_id != expected_id:
            raise FieldError("group_id", f"must be group_id_for(prompt.prompt_id) = {expected_id!r}")
        if self.prompt_token_ids.shape[0] == 0:
            raise FieldError("prompt_token_ids", "is empty (P must be ≥ 1)")
        for i, completion in enumerate(self.completions):
            if completion.topk_ids.shape[1] != self.topk:
                raise FieldError(f"completions[{i}].topk_ids", f"K must be the group's topk {self.topk}")
            if completion.num_tokens > self.sampling.max_new_tokens:
                raise FieldError(f"completions[{i}].token_ids", "exceeds sampling.max_new_tokens")
        return self


class EpisodePiece(WireModel):
    """One piece of an episode's token stream: a model turn as sampled, or an environment turn's tokens."""

    model: Completion | None = Field(default=None, description="A model turn: tokens, log-probs, versions.")
    environment: list[int] | None = Field(
        default=None, max_length=1_000_000, description="An environment turn's token ids (context)."
    )

    @model_validator(mode="after")
    def _one(self) -> "EpisodePiece":
        if (self.model is None) == (self.environment is None):
            raise FieldError("model", "a piece is a model turn or an environment turn: exactly one")
        return self


class HeldEpisode(WireModel):
    """One episode of a group handed over, as far as it got. Its environment lives on in the environment
    service under `episode_id` (the only place an environment's state survives its worker)."""

    episode_id: str = Field(pattern=EPISODE_ID_PATTERN, description="The environment service's episode.")
    samples: list[list[EpisodePiece]] = Field(
        min_length=1, description="Its samples' pieces: those split off, then the one in the making."
    )
    turns: int = Field(ge=0, description="Model turns so far.")
    messages: list[ChatMessage] = Field(description="The history as messages (the template's input).")
    opening: int = Field(ge=1, description="How many of `messages` the prompt is.")
    status: str = Field(max_length=64, description="`running`, or how it ended.")
    answer: str = Field(default="", description="The model's last turn, as text.")
    tool_calls: dict[str, int] = Field(default_factory=dict, description="Its tool calls by status.")
    environment_seconds: list[float] = Field(default_factory=list, description="Each environment answer.")


class PartialEpisodes(WireModel):
    """A group of multi-turn episodes (rollout.agent with an environment service) not finished when its
    worker stopped. Writer: the worker that stopped, under `{ns}:value:episodes:<group id>`, before it
    releases the prompt. Reader: the worker that takes the prompt next, which plays the running episodes
    on from where they were (their environments still held by the service) and publishes the group once
    every episode has ended; the record is deleted then."""

    schema_version: Literal[1] = Field(
        default=PARTIAL_SCHEMA_VERSION, description="Wire version; readers reject others."
    )
    group_id: str = Field(description="`group_id_for(prompt_id)`: the group the episodes make.")
    prompt_token_ids: Int32Array1D = Field(
        description="The prompt as the worker tokenized it when it pulled it; the continuing worker goes on "
        "only when its own tokenization is the same."
    )
    context_ids: Int32Array1D = Field(description="The prompt as the episodes saw it (with the tools).")
    environment: str = Field(min_length=1, max_length=256, description="rollout.agent.environment.")
    url: str = Field(min_length=1, max_length=2048, description="The environment service holding them.")
    tools: list[dict[str, Any]] = Field(
        default_factory=list, max_length=256, description="The tools' schemas the episodes were shown."
    )
    episodes: list[HeldEpisode] = Field(min_length=1, description="The group's n episodes, in order.")
    producer: str = Field(min_length=1, max_length=128, description="The worker that played them so far.")
    saved_at: float = Field(ge=0, description="Unix time (s) they were saved.")
