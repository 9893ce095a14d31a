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
- `countdown_retry`: no tools; a wrong countdown answer is told so and asked again, up to `tries` turns in
  all; the reward is 1 for a correct answer at any turn. Multi-turn episodes a model that calls no tool
  already plays (the demo's tiny model), so the whole stack's multi-turn path runs in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sparkrl.proto import Prompt
from sparkrl.services.common.tasks.countdown import score_countdown
from sparkrl.services.common.tools import Calculator, PythonInterpreter


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


ENVIRONMENTS: dict[str, Callable[[], Any]] = {
    "calculator": Calculator,
    "python": PythonInterpreter,
    "countdown_retry": CountdownRetry,
}


def make_environment(name: str) -> Any:
    """A fresh environment (one per episode) of the registered `name`."""
    try:
        factory = ENVIRONMENTS[name]
    except KeyError:
        known = ", ".join(sorted(ENVIRONMENTS))
        raise ValueError(
            f"unknown environment {name!r}: rollout.agent.environment is one of {known}"
        ) from None
    return factory()
