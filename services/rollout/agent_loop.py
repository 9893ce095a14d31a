"""Multi-turn episodes on an engine (issue 48, item 4 begun): many episodes at once, each turn of all of
them decoded together, every episode kept as a token stream (episode.py), never re-rendered.

A turn: the engine samples one completion per live episode from its whole context; the model's tokens go
into the stream as sampled; its text is read for tool calls (tools.py). With calls, the environment runs
them and its observations are the next turn (`tool` messages); without, an environment that has
`respond(text) -> str | None` answers as the user, or ends the episode with None; one without `respond`
ends it (the model gave its answer). The environment's turn is tokenized on its own between the
template's delimiters (`episode.environment_turn`).

An episode ends `done`, or at a limit: `max_turns` model turns, `max_tokens` of context. Where the
template cannot extend the stream exactly it ends `no_exact_continuation` (to become a split into
separate training samples when episodes reach the learner). The episode's reward is the environment's
`get_reward()` when it has one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from sparkrl.proto import Completion
from sparkrl.services.common.settings import SamplingSettings
from sparkrl.services.common.tools import call_tool, parse_tool_calls
from sparkrl.services.rollout.engine import Engine
from sparkrl.services.rollout.episode import Episode, Message, environment_turn

ENDINGS = ("done", "max_turns", "max_tokens", "no_exact_continuation")


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4  # model turns
    max_tokens: int = 2048  # the whole context: prompt and stream


@dataclass
class EpisodeRun:
    """One episode in flight: its stream, the messages the template's delimiters are computed from,
    its environment, how it ended and what its tools answered (by status)."""

    episode: Episode
    messages: list[Message]
    environment: Any
    status: str = "running"
    tool_calls: Counter[str] = field(default_factory=Counter)
    reward: float | None = None


def run_episodes(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    environments: list[Any],
    prompts: list[list[Message]],
    sampling: SamplingSettings,
    limits: EpisodeLimits | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[EpisodeRun]:
    """Each environment's episode from its prompt messages, to its end."""
    limits = limits or EpisodeLimits()
    runs = []
    for environment, messages in zip(environments, prompts, strict=True):
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )
        ids = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        runs.append(EpisodeRun(Episode(ids), list(messages), environment))
    one = sampling.model_copy(update={"n": 1})
    while live := [run for run in runs if run.status == "running"]:
        groups = engine.generate([run.episode.context for run in live], one)
        for run, (completion,) in zip(live, groups, strict=True):
            _turn(run, completion, tokenizer, limits, template_kwargs)
    for run in runs:
        get_reward = getattr(run.environment, "get_reward", None)
        run.reward = None if get_reward is None else float(get_reward())
    return runs


def _turn(
    run: EpisodeRun,
    completion: Completion,
    tokenizer: PreTrainedTokenizerBase,
    limits: EpisodeLimits,
    template_kwargs: dict[str, Any] | None,
) -> None:
    tokens = [int(t) for t in completion.token_ids]
    run.episode.add_model_turn(completion)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    reply = _reply(run, text)
    if reply is None:
        run.status = "done"
        return
    if run.episode.turns >= limits.max_turns:
        run.status = "max_turns"
        return
    stopped = tokens[-1] if tokens and completion.finish_reason == "stop" else None
    between = environment_turn(tokenizer, run.messages, reply, stopped, template_kwargs)
    run.messages += [{"role": "assistant", "content": text}, *reply]
    if between is None:
        run.status = "no_exact_continuation"
    elif len(run.episode.context) + len(between) >= limits.max_tokens:
        run.status = "max_tokens"
    else:
        run.episode.add_environment_turn(between)


def _reply(run: EpisodeRun, text: str) -> list[Message] | None:
    """The environment's turn after the model's `text`: tool results, a user message, or None (done)."""
    calls = parse_tool_calls(text)
    if calls:
        observations = [call_tool(run.environment, call) for call in calls]
        run.tool_calls.update(o.status for o in observations)
        return [{"role": "tool", "content": o.text} for o in observations]
    respond = getattr(run.environment, "respond", None)
    said = None if respond is None else respond(text)
    return None if said is None else [{"role": "user", "content": said}]
