"""How long a prompt may be, decided once from the settings and the model, and applied the same way by
every path a prompt takes: the feeder (the start file, `sparkrl prompts`) before it publishes, the worker
before it tokenizes.

`rollout.max_prompt_tokens` unset is the model's context (`rollout.engine.max_model_len`, else the
model's config: `max_position_embeddings`) less the completion budget (`rollout.sampling.max_new_tokens`),
so a prompt that cannot fit beside its answer is never prefilled; a value set above that is an error.

Tokens are counted only after a cheap bound on characters: a prompt longer than `max_prompt_tokens` ×
`rollout.max_prompt_chars_per_token` characters is over the limit without being tokenized (a 2 MB string
handed to the tokenizer, then prefilled, took a worker from 0.6 to 10.9 GB). Real text averages 3 to 5
characters a token, so the default (32) refuses nothing the token limit would take.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from sparkrl.proto import Prompt

log = logging.getLogger("sparkrl.prompt_limits")

# A model's context, as Hugging Face configs name it (the first found wins; a multimodal model's language
# part keeps it under `text_config`).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
REFUSALS_SAID = 10  # a feed says this many refused prompts one by one, then only counts them


class PromptBudgetError(ValueError):
    """`rollout.max_prompt_tokens` (or the completion budget) does not fit the model's context; the message
    names the fix."""


class _Sampling(Protocol):
    @property
    def max_new_tokens(self) -> int: ...


class PromptBudget(Protocol):
    """What bounds a prompt: `RolloutSettings`, or the feeder's part of it (`roles.PromptBudget`)."""

    @property
    def max_prompt_tokens(self) -> int | None: ...

    @property
    def max_prompt_chars_per_token(self) -> int: ...

    @property
    def overlong(self) -> Literal["drop", "truncate"]: ...

    @property
    def sampling(self) -> _Sampling: ...

    @property
    def engine(self) -> object: ...  # its `max_model_len` (vLLM), where it has one


def context_of(config: dict, max_model_len: int | None = None) -> int | None:
    """The model's context in tokens: `max_model_len` when set (vLLM's cap), else the config's; None when
    the config does not say."""
    if max_model_len:
        return max_model_len
    for part in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            value = part.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def model_context(model_dir: Path, max_model_len: int | None = None) -> int | None:
    """`context_of` the model directory's config.json; None when it is not there (a feeder that has only
    the settings: the workers, which load the model, still apply the limit)."""
    if max_model_len:
        return max_model_len
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return context_of(config) if isinstance(config, dict) else None


def resolve_max_prompt_tokens(explicit: int | None, context: int | None, max_new_tokens: int) -> int | None:
    """The prompt budget in tokens: `explicit` where it fits beside `max_new_tokens` in `context`, the
    room left when unset; None only when neither is known."""
    if context is None:
        return explicit
    room = context - max_new_tokens
    if room < 1:
        raise PromptBudgetError(
            f"rollout.sampling.max_new_tokens ({max_new_tokens}) fills the model's context ({context}), "
            f"leaving no room for a prompt: lower it (e.g. to {context // 4})"
        )
    if explicit is not None and explicit > room:
        raise PromptBudgetError(
            f"rollout.max_prompt_tokens ({explicit}) + rollout.sampling.max_new_tokens ({max_new_tokens}) "
            f"exceeds the model's context ({context}): set rollout.max_prompt_tokens to {room} or less "
            f"(unset, it is {room}), or lower rollout.sampling.max_new_tokens"
        )
    return room if explicit is None else explicit


def prompt_chars(prompt: Prompt) -> int:
    """The prompt's length in characters (its text, or its messages' contents)."""
    if prompt.text is not None:
        return len(prompt.text)
    return sum(len(message.content) for message in prompt.messages or [])


def last_chars(prompt: Prompt, limit: int) -> Prompt:
    """The prompt cut to its last `limit` characters (whole later messages first): what `overlong:
    truncate` keeps of its tokens lies in them, as no token averages more than the bound's characters."""
    if prompt.text is not None:
        return prompt.model_copy(update={"text": prompt.text[-limit:]})
    kept, room = [], limit
    for message in reversed(prompt.messages or []):
        if room <= 0:
            break
        content = message.content[-room:]
        kept.append(message.model_copy(update={"content": content}))
        room -= len(content)
    return prompt.model_copy(update={"messages": kept[::-1]})


@dataclass(frozen=True)
class PromptLimits:
    """The resolved limits; `max_tokens` None: no limit (the model's context unknown and none set)."""

    max_tokens: int | None = None
    chars_per_token: int = 32
    overlong: Literal["drop", "truncate"] = "drop"
    origin: str = ""  # how an unset max_tokens was found: said with it in every reason

    @property
    def max_chars(self) -> int | None:
        return None if self.max_tokens is None else self.max_tokens * self.chars_per_token

    def describe(self) -> str:
        """`rollout.max_prompt_tokens (N)`, with where N came from when it was not set."""
        origin = f", {self.origin}" if self.origin else ""
        return f"rollout.max_prompt_tokens ({self.max_tokens}{origin})"

    def screen(self, prompt: Prompt) -> tuple[Prompt | None, str | None]:
        """The character bound, before any tokenizer: (the prompt, cut to the bound with `truncate`; None
        when it is dropped, with the reason)."""
        limit, chars = self.max_chars, prompt_chars(prompt)
        if limit is None or chars <= limit:
            return prompt, None
        if self.overlong == "truncate":
            return last_chars(prompt, limit), None
        return None, (
            f"prompt has {chars} characters, over {self.describe()} × rollout.max_prompt_chars_per_token "
            f"({self.chars_per_token}) = {limit}: not tokenized"
        )

    def over_tokens(self, tokens: int) -> str | None:
        """The reason a prompt of `tokens` tokens is dropped; None when it fits (or `truncate` cuts it)."""
        if self.max_tokens is None or tokens <= self.max_tokens or self.overlong == "truncate":
            return None
        return f"prompt has {tokens} tokens, over {self.describe()}"


def resolve_limits(budget: PromptBudget, model_dir: Path | None) -> PromptLimits:
    """The limits `budget` gives with the model in `model_dir` (its context read from its config.json);
    raises PromptBudgetError when the settings do not fit the model."""
    max_model_len = getattr(budget.engine, "max_model_len", None)
    context = model_context(model_dir, max_model_len) if model_dir is not None else max_model_len
    new_tokens = budget.sampling.max_new_tokens
    tokens = resolve_max_prompt_tokens(budget.max_prompt_tokens, context, new_tokens)
    origin = ""
    if budget.max_prompt_tokens is None and tokens is not None:
        origin = f"the model's context {context} − rollout.sampling.max_new_tokens {new_tokens}"
    return PromptLimits(tokens, budget.max_prompt_chars_per_token, budget.overlong, origin)


def feeder_limits(budget: PromptBudget, model_dir: Path) -> PromptLimits:
    """`resolve_limits` for a feeder, which samples nothing: settings that do not fit the model (a one-off
    `sparkrl prompts` given another tree than the run's) are said, and the context alone bounds a prompt,
    as no prompt longer than it can ever be taken; the workers refuse such settings themselves."""
    try:
        return resolve_limits(budget, model_dir)
    except PromptBudgetError as exc:
        context = model_context(model_dir, getattr(budget.engine, "max_model_len", None))
        log.warning("%s; the feeder bounds prompts by the model's context alone (%s tokens)", exc, context)
        origin = "the model's context, as the rollout settings given here do not fit it"
        return PromptLimits(context, budget.max_prompt_chars_per_token, budget.overlong, origin)
