"""The environments that ship (issue 48, item 1), by the name `rollout.agent.environment` gives.

An environment is TRL's `environment_factory` shape: a class made once per episode, whose public,
type-hinted methods are its tools (tools.py), with three methods of its own, each optional:

- `reset(prompt: Prompt) -> str | None`: called first; text to add to the prompt's last user turn (None:
  nothing), e.g. what the tools are for.
- `respond(text: str) -> str | None`: the model's turn had no tool call; the environment answers as the
  user, or None to end the episode (without `respond`, a turn without a call ends it: the model answered).
- `get_reward() -> float`: the episode's reward, when the environment keeps one (`rollout.agent.reward`
  says whether the verifier's, the environment's or their sum trains).

Shipped:

- `calculator`: the arithmetic tool (no `eval`: the expression's syntax tree is walked).
- `python`: the sandboxed interpreter (sandbox.py: its own uid, network and mount namespaces, limits).
- `lookup`: a box's secret that only its tool knows (the agent preset: tiny_agent.py).
- `countdown_retry`: no tools; a wrong countdown answer is told so and asked again, up to `tries` turns in
  all; the reward is 1 for a correct answer at any turn. Multi-turn episodes a model that calls no tool
  already plays (the demo's tiny model), so the whole stack's multi-turn path runs in tests.
"""

from __future__ import annotations

import importlib
import re
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from sparkrl.proto import ChatMessage, Prompt
from sparkrl.proto.environment import EpisodeEnded, EpisodeReply, EpisodeStarted
from sparkrl.services.common.tasks.countdown import score_countdown
from sparkrl.services.common.tools import (
    Calculator,
    PythonInterpreter,
    call_tool,
    parse_tool_calls,
    tool_schemas,
)


class CountdownRetry:
    """Countdown with another try after a wrong answer; no tools."""

    def __init__(self, tries: int = 3) -> None:
        self.tries, self.turns, self.solved = tries, 0, False
        self.numbers: list[int] = []
        self.target = 0

    def reset(self, prompt: Prompt) -> str | None:
        data = prompt.task_data or {}
        if not isinstance(data.get("numbers"), list) or not isinstance(data.get("target"), int):
            raise ValueError(f"countdown_retry needs task_data numbers and target, prompt {prompt.prompt_id}")
        self.numbers, self.target = [int(n) for n in data["numbers"]], int(data["target"])
        return None

    def respond(self, text: str) -> str | None:
        self.turns += 1
        score, _, detail = score_countdown(text, self.numbers, self.target)
        self.solved = self.solved or score >= 1.0
        if self.solved or self.turns >= self.tries:
            return None
        numbers = " ".join(str(n) for n in self.numbers)
        return f"Wrong ({detail}). Use {numbers} to make {self.target}.\n"

    def get_reward(self) -> float:
        return 1.0 if self.solved else 0.0


class Lookup:
    """A box's secret, which only this tool knows: the prompt names the box (`{"box": N}`), its answer is
    the secret; a model answers right only by looking it up (the agent preset, tiny_agent.py)."""

    def __init__(self) -> None:
        self.box: int | None = None
        self.secret = ""

    def reset(self, prompt: Prompt) -> str | None:
        found = BOX.search(prompt.text or "".join(m.content for m in prompt.messages or ()))
        if found is None or not prompt.answer:
            raise ValueError(
                f'lookup needs a prompt naming {{"box": N}} and its secret as the answer ({prompt.prompt_id})'
            )
        self.box, self.secret = int(found.group(1)), prompt.answer
        return None

    def lookup(self, box: int) -> str:
        """The secret in a box.

        Args:
            box: The box's number.
        """
        return self.secret if box == self.box else "empty"


BOX = re.compile(r'\{"box": (\d{1,9})\}')

ENVIRONMENTS: dict[str, Callable[[], Any]] = {
    "calculator": Calculator,
    "python": PythonInterpreter,
    "countdown_retry": CountdownRetry,
    "lookup": Lookup,
}


def environment_factory(name: str) -> Callable[[], Any]:
    """What makes an episode's environment: a shipped one by `name`, or the class a `package.module:Class`
    import path names (importable where the episodes run). Errors name the fix."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if ":" not in name:
        known = ", ".join(sorted(ENVIRONMENTS))
        raise ValueError(
            f"unknown environment {name!r}: rollout.agent.environment is one of {known}, "
            "or your own class as package.module:Class"
        )
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"environment {name!r}: cannot import {module_name} ({exc}); install it where the episodes "
            "run, or put its folder on PYTHONPATH"
        ) from exc
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"environment {name!r}: {module_name} has no class {attribute}")
    return factory


def check_environment(name: str, reward: str = "verifier") -> None:
    """Raise, naming the fix, what would fail every episode of `name`: it does not load or construct,
    a tool has no hints or docstring (tools.tool_schemas), or `reward` (rollout.agent.reward) asks for
    a `get_reward` it lacks. The worker and `sparkrl up`'s preflight call it before anything runs."""
    factory = environment_factory(name)
    try:
        environment = factory()
    except Exception as exc:  # the user's constructor
        raise ValueError(f"environment {name!r} cannot be made: {type(exc).__name__}: {exc}") from exc
    tool_schemas(environment)
    if reward != "verifier" and not callable(getattr(environment, "get_reward", None)):
        raise ValueError(
            f"rollout.agent.reward {reward}: environment {name!r} keeps no reward (no get_reward); "
            "use verifier, or give it a get_reward() -> float"
        )


def make_environment(name: str) -> Any:
    """A fresh environment (one per episode) of `name` (`environment_factory`)."""
    return environment_factory(name)()


class Session(Protocol):
    """One episode's environment as the agent loop drives it: in this process (`LocalSession`) or in an
    environment service over HTTP (the rollout worker's `RemoteSession`); the same answers either way."""

    def start(self, prompt: Prompt) -> EpisodeStarted: ...

    def turn(self, text: str) -> EpisodeReply: ...

    def end(self) -> EpisodeEnded: ...


class LocalSession:
    """An environment object driven in this process. `start` raises what `reset` raises (the prompt is
    refused); `turn` and `end` never raise: what the environment's own code raises is their `error`."""

    def __init__(self, environment: Any) -> None:
        self.environment = environment

    def start(self, prompt: Prompt) -> EpisodeStarted:
        reset = getattr(self.environment, "reset", None)
        said = reset(prompt) if callable(reset) else None
        return EpisodeStarted(episode_id="0" * 32, said=said or None, tools=tool_schemas(self.environment))

    def turn(self, text: str) -> EpisodeReply:
        """Tool calls in `text` answered (each an observation, never an exception), else `respond`."""
        calls = parse_tool_calls(text)
        if calls:
            observations = [call_tool(self.environment, call) for call in calls]
            messages = [ChatMessage(role="tool", content=o.text) for o in observations]
            return EpisodeReply(messages=messages, tool_calls=dict(Counter(o.status for o in observations)))
        respond = getattr(self.environment, "respond", None)
        try:
            said = None if respond is None else respond(text)
        except Exception as exc:  # the environment's code
            return EpisodeReply(messages=None, error=f"respond: {type(exc).__name__}: {exc}"[:2000])
        return EpisodeReply(messages=None if said is None else [ChatMessage(role="user", content=said)])

    def end(self) -> EpisodeEnded:
        get_reward = getattr(self.environment, "get_reward", None)
        if get_reward is None:
            return EpisodeEnded(reward=None)
        try:
            return EpisodeEnded(reward=float(get_reward()))
        except Exception as exc:  # the environment's code
            return EpisodeEnded(reward=None, error=f"get_reward: {type(exc).__name__}: {exc}"[:2000])
