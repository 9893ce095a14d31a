"""Multi-turn episodes on an engine (issue 48, item 4): many episodes at once, each turn of all of them
decoded together, every episode kept as a token stream (episode.py), never re-rendered.

A turn: the engine samples one completion per live episode from its whole context; the model's tokens go
into the stream as sampled; its text goes to the episode's environment session (environments.py: in this
process, or an environment service over HTTP), which answers: tool calls with their observations (`tool`
messages), else `respond`'s user message, or the end of the episode. Through a chat template the
environment's turn is tokenized on its own between the template's delimiters (`episode.environment_turn`);
without one (a base model, plain text) it is the messages' contents, one a line, tokenized alone.

An episode ends `done`, or at a limit: `max_turns` model turns, `max_tokens` of context. Where the
template cannot extend the stream exactly (it rewrites earlier turns), the episode is split: the next
sample starts from the whole history re-rendered (episode.py); where even that does not start with the
prompt's tokens it ends `no_exact_continuation` (counted: the learner trains what was made up to there).
The episode's reward is the environment's `get_reward()` when it has one; an
environment whose own code raises ends it `environment_error`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from sparkrl.proto import Completion, Prompt
from sparkrl.proto.environment import EpisodeReply
from sparkrl.services.common.environments import LocalSession, Session, make_environment
from sparkrl.services.common.modeling import prompt_messages, render_prompt, template_in_force
from sparkrl.services.common.settings import PromptFormat, SamplingSettings
from sparkrl.services.common.settings.rollout import AgentSettings
from sparkrl.services.rollout.engine import Engine
from sparkrl.services.rollout.episode import Episode, Message, environment_turn
from sparkrl.services.rollout.remote_env import EnvironmentUnavailable

CONCURRENT_CALLS = 32  # environment calls of one turn in flight at once
ENDINGS = ("done", "max_turns", "max_tokens", "no_exact_continuation", "environment_error")


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4  # model turns
    max_tokens: int = 2048  # the whole context: prompt and stream


@dataclass
class EpisodeRun:
    """One episode in flight: its stream, the messages the template's delimiters are computed from,
    its environment's session, how it ended, what its tools answered (by status) and the model's last
    turn."""

    episode: Episode
    messages: list[Message]
    session: Session
    status: str = "running"
    tool_calls: Counter[str] = field(default_factory=Counter)
    reward: float | None = None
    answer: str = ""  # the model's last turn, as text: what a verifier reads
    error: str | None = None  # status environment_error: what the environment's own method raised
    environment_seconds: list[float] = field(default_factory=list)  # each of its turns' answer took
    opening: int = 0  # how many of `messages` the prompt is (set when it starts)
    tools: list[dict[str, Any]] = field(default_factory=list)  # the tools' schemas it was shown

    def answer_turn(self, text: str) -> EpisodeReply:
        """The environment's answer to the model's turn `text`, timed."""
        started = time.monotonic()
        try:
            return self.session.turn(text)
        finally:
            self.environment_seconds.append(time.monotonic() - started)

    def completion(self, tokenizer: PreTrainedTokenizerBase) -> Completion:
        """The sample in the making (the whole episode, unless it was split) as one wire completion."""
        return self.episode.completion(tokenizer.decode(self.episode.token_ids, skip_special_tokens=True))

    def completions(self, tokenizer: PreTrainedTokenizerBase) -> list[Completion]:
        """Every training sample of the episode (one, or one more per split), each its stream's text."""
        return self.episode.completions(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


@dataclass(frozen=True)
class Turns:
    """How a model's turns and an environment's are written: through the chat template (its variables
    `kwargs`, the tools' schemas among them) or as plain text."""

    tokenizer: PreTrainedTokenizerBase
    template: bool
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls, tokenizer: PreTrainedTokenizerBase, fmt: PromptFormat, schemas: list[dict[str, Any]]
    ) -> Turns:
        template = template_in_force(tokenizer, fmt)
        if schemas and not template:
            raise ValueError(
                "an environment with tools needs a chat template to show them: the model has none"
            )
        return cls(
            tokenizer, template, {**fmt.chat_template_kwargs, **({"tools": schemas} if schemas else {})}
        )

    def rerendered(self, opening: list[Message], messages: list[Message]) -> list[int] | None:
        """The tokens after the prompt (`opening` rendered) of the whole history `messages` rendered with
        the generation prompt, the rest tokenized on its own; None when the history's text does not start
        with the prompt's."""
        prompt, history = (
            self.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True, **self.kwargs)
            for m in (opening, messages)
        )
        if not history.startswith(prompt) or len(history) == len(prompt):
            return None
        return list(self.tokenizer(history[len(prompt) :], add_special_tokens=False)["input_ids"])

    def between(self, history: list[Message], reply: list[Message], stopped: int | None) -> list[int] | None:
        if self.template:
            return environment_turn(self.tokenizer, history, reply, stopped, self.kwargs)
        text = "\n".join(str(m["content"]) for m in reply)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def play(
    engine: Engine,
    prompts: list[Prompt],
    sampling: SamplingSettings,
    agent: AgentSettings,
    fmt: PromptFormat,
    open_session: Callable[[], Session] | None = None,
    between_turns: Callable[[], bool | None] | None = None,
    resumed: Resumed | None = None,
) -> tuple[list[list[EpisodeRun]], dict[int, str]]:
    """`sampling.n` episodes for each prompt, played together to their ends, and the prompts whose
    environment refused to start (index → why; no episode of theirs). `open_session`: one episode's
    environment (default: `agent.environment` in this process); `between_turns`: called after each turn
    (the worker takes a newer policy version there, with `weight_updates: in_flight`), True to stop there
    (the episodes come back as far as they got, `running`, none ended: handed over); `resumed`: prompts
    whose episodes another worker began (episode_handover.py), played on from there."""
    if open_session is None:
        if agent.environment is None:
            raise ValueError("rollout.agent.environment is not set: there is no environment to play")
        name = agent.environment

        def open_session() -> Session:
            return LocalSession(make_environment(name))

    resumed = resumed or Resumed()
    started: dict[int, list[tuple[Session, list[Message], list[dict[str, Any]]]]] = {}
    refused: dict[int, str] = {}
    for index, prompt in enumerate(prompts):
        if index in resumed.runs:
            continue
        try:
            started[index] = [_start(open_session(), prompt, fmt) for _ in range(sampling.n)]
        except EnvironmentUnavailable:
            raise  # the service, not the prompt: the batch waits to be reclaimed
        except Exception as exc:  # the environment's reset (here, or in its service), on this prompt
            refused[index] = f"{type(exc).__name__}: {exc}"
    triples = [triple for index in sorted(started) for triple in started[index]]
    if not triples and not resumed.runs:
        return [[] for _ in prompts], refused
    turns = Turns.of(engine.tokenizer, fmt, triples[0][2] if triples else resumed.tools)
    opened = iter(open_episodes(engine, [t[0] for t in triples], [t[1] for t in triples], turns, fmt))
    episodes = [
        resumed.runs[i]
        if i in resumed.runs
        else [next(opened) for _ in range(sampling.n)]
        if i in started
        else []
        for i in range(len(prompts))
    ]
    limits = EpisodeLimits(agent.max_turns, agent.max_tokens)
    play_on(engine, [run for group in episodes for run in group], sampling, limits, turns, between_turns)
    return episodes, refused


@dataclass
class Resumed:
    """Episodes another worker began, by prompt index, and the tools' schemas they were shown."""

    runs: dict[int, list[EpisodeRun]] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)


def _start(
    session: Session, prompt: Prompt, fmt: PromptFormat
) -> tuple[Session, list[Message], list[dict[str, Any]]]:
    """The episode's session started on `prompt`, its first messages (what `reset` said added to the
    last one) and the tools' schemas."""
    started = session.start(prompt)
    messages = prompt_messages(prompt.messages or prompt.text or "", fmt.system_prompt)
    if started.said:
        messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']}{started.said}"}
    return session, messages, started.tools


def run_episodes(
    engine: Engine,
    sessions: list[Session],
    prompts: list[list[Message]],
    sampling: SamplingSettings,
    limits: EpisodeLimits | None = None,
    turns: Turns | None = None,
    fmt: PromptFormat | None = None,
    between_turns: Callable[[], bool | None] | None = None,
) -> list[EpisodeRun]:
    """Each session's episode from its prompt messages, to its end (`turns`: through the tokenizer's
    chat template by default). `between_turns` runs after each turn while episodes go on: a new policy
    version it loads into the engine samples the next turns, and their tokens' versions say so."""
    turns = turns or Turns(engine.tokenizer, True)
    runs = open_episodes(engine, sessions, prompts, turns, fmt or PromptFormat())
    play_on(engine, runs, sampling, limits or EpisodeLimits(), turns, between_turns)
    return runs


def open_episodes(
    engine: Engine, sessions: list[Session], prompts: list[list[Message]], turns: Turns, fmt: PromptFormat
) -> list[EpisodeRun]:
    """An episode for each session, its prompt rendered once (with the tools' schemas)."""
    with_tools = fmt.model_copy(update={"chat_template_kwargs": turns.kwargs})
    return [
        EpisodeRun(
            Episode(render_prompt(engine.tokenizer, messages, with_tools)),
            list(messages),
            session,
            opening=len(messages),
            tools=list(turns.kwargs.get("tools", [])),
        )
        for session, messages in zip(sessions, prompts, strict=True)
    ]


def play_on(
    engine: Engine,
    runs: list[EpisodeRun],
    sampling: SamplingSettings,
    limits: EpisodeLimits,
    turns: Turns,
    between_turns: Callable[[], bool | None] | None = None,
) -> bool:
    """The running episodes of `runs`, turn by turn, to their ends, then every one ended (its reward read,
    its environment forgotten); False when `between_turns` said stop (nothing ended: handed over)."""
    one = sampling.model_copy(update={"n": 1})
    # The environments answer a turn's episodes at once (a service's round trips, a sandbox's processes
    # overlap); everything else of a turn runs here, in order.
    with ThreadPoolExecutor(max_workers=CONCURRENT_CALLS, thread_name_prefix="env") as calls:
        while live := [run for run in runs if run.status == "running"]:
            groups = engine.generate([run.episode.context for run in live], one)
            completions = [completion for (completion,) in groups]
            texts = [_model_turn(run, c, turns) for run, c in zip(live, completions, strict=True)]
            answers = calls.map(EpisodeRun.answer_turn, live, texts)
            room = limits.max_tokens - one.max_new_tokens  # the next model turn must fit after
            for run, completion, answer in zip(live, completions, answers, strict=True):
                _environment_turn(run, completion, answer, turns, limits.max_turns, room)
            if between_turns is not None and any(run.status == "running" for run in runs):
                if between_turns():
                    return False
        endings = calls.map(lambda run: run.session.end(), runs)  # a service forgets each episode here
        for run, ended in zip(runs, endings, strict=True):
            run.reward = ended.reward
            if ended.error is not None and run.error is None:
                run.status, run.error = "environment_error", ended.error
    return True


def _model_turn(run: EpisodeRun, completion: Completion, turns: Turns) -> str:
    """The model's turn into the stream; its text, for the environment."""
    run.episode.add_model_turn(completion)
    run.answer = turns.tokenizer.decode([int(t) for t in completion.token_ids], skip_special_tokens=True)
    return run.answer


def _environment_turn(
    run: EpisodeRun, completion: Completion, answer: EpisodeReply, turns: Turns, max_turns: int, room: int
) -> None:
    """The environment's answer to the model's turn: the episode ends, or its turn goes into the stream
    (when the context stays within `room`: max_tokens less the next turn's new tokens)."""
    tokens, text = [int(t) for t in completion.token_ids], run.answer
    run.tool_calls.update(answer.tool_calls)
    if answer.error is not None:
        run.status, run.error = "environment_error", answer.error
        return
    if answer.messages is None:
        run.status = "done"
        return
    reply = [message.model_dump() for message in answer.messages]
    if run.episode.turns >= max_turns:
        run.status = "max_turns"
        return
    stopped = tokens[-1] if tokens and completion.finish_reason == "stop" else None
    between = turns.between(run.messages, reply, stopped)
    run.messages += [{"role": "assistant", "content": text}, *reply]
    if between is not None:
        if len(run.episode.context) + len(between) > room:
            run.status = "max_tokens"
        else:
            run.episode.add_environment_turn(between)
        return
    # No exact continuation: a new sample from the whole history re-rendered after the prompt.
    history = turns.rerendered(run.messages[: run.opening], run.messages) if turns.template else None
    if history is None:
        run.status = "no_exact_continuation"
    elif len(run.episode.prompt_ids) + len(history) > room:
        run.status = "max_tokens"
    else:
        run.episode.split(history)
