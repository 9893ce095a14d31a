"""Environments of the tests' own, loaded as users load theirs (`rollout.agent.environment:
_code_envs:ModelCode`, with tests/ on PYTHONPATH): each sends code to the shipped Python tool, the
sandboxed interpreter (services/common/tools.py `PythonInterpreter`), on every turn of an episode.

They answer through `respond`, as the user, rather than as tools: the tiny models the tests play
(plain text, no chat template) write no tool calls, and every turn must run code for the tests to hold.
The interpreter is private (`_python`), so neither offers a tool to the model."""

from __future__ import annotations

import itertools
import time

from sparkrl.proto import Prompt
from sparkrl.services.common.sandbox import SandboxLimits
from sparkrl.services.common.tools import PythonInterpreter

# Tight limits: a turn's attack ends in seconds, on two shared cores.
LIMITS = SandboxLimits(cpu_s=2, wall_s=4.0, memory_mb=256, file_mb=4, processes=8, output_bytes=2_000)

# Code that breaks each guarantee (docs/agents.md, the sandbox's), by name; each attack's observation
# starts with its name, so the episodes' text shows which ones the model saw.
ATTACKS = {
    "loop": "while True:\n    pass",
    "memory": "x = bytearray(10 << 30)\nprint(len(x))",  # 10 GB
    "fork": "import os\nwhile True:\n    os.fork()",
    "socket": (
        "import socket\ns = socket.create_connection(('127.0.0.1', 6379), timeout=1)\n"
        "print('connected', s.getpeername())"
    ),
    "write": "open('/etc/sparkrl-was-here', 'w').write('x')\nprint('wrote outside')",
    "flood": "for _ in range(100):\n    print('z' * (1 << 20))",  # 100 MB of output
}
_episodes = itertools.count()  # each episode of this process starts its round of the attacks elsewhere


def said(name: str, status: str, seconds: float, text: str = "") -> str:
    """An observation as the next user turn, short: the tiny models' context is 256 tokens of about a
    character each, and an episode of `Attacks` holds six."""
    return f"[{name}: {status} {seconds:.1f}s]{f' {text[:40]}' if text else ''}\n"


class ModelCode:
    """Each model turn is run as a Python program; its output (or error) is the next user turn. The
    episode ends after `turns` model turns; the reward is the share of turns whose code ran cleanly."""

    def __init__(self, turns: int = 3) -> None:
        self._python = PythonInterpreter(LIMITS)
        self.turns, self.limit, self.clean = 0, turns, 0

    def reset(self, prompt: Prompt) -> str | None:
        return None

    def respond(self, text: str) -> str | None:
        self.turns += 1
        start = time.monotonic()
        seen = self._python.python(text)
        self.clean += seen.status == "ok"
        took = time.monotonic() - start
        return None if self.turns >= self.limit else said("code", seen.status, took, seen.text)

    def get_reward(self) -> float:
        return self.clean / max(self.turns, 1)


class Attacks:
    """Whatever the model says, each turn runs the next of `ATTACKS` (all of them, in turn, from where
    this episode starts the round) and answers with what the sandbox made of it; the episode ends when the
    model has seen every attack."""

    def __init__(self) -> None:
        self._python = PythonInterpreter(LIMITS)
        self.turns, self.first = 0, next(_episodes)

    def reset(self, prompt: Prompt) -> str | None:
        return None

    def respond(self, text: str) -> str | None:
        self.turns += 1
        if self.turns > len(ATTACKS):
            return None
        name = list(ATTACKS)[(self.first + self.turns) % len(ATTACKS)]
        start = time.monotonic()
        seen = self._python.python(ATTACKS[name])
        return said(name, seen.status, time.monotonic() - start)


class SlowTalker:
    """A user who takes a second to answer each turn (a simulator's step, a remote service's latency), four
    times, then is satisfied: episodes long enough for a worker to be stopped between their turns. The
    reward is 1 for an episode that reached its end, which only a worker that played it on can give."""

    def __init__(self) -> None:
        self.heard = 0

    def reset(self, prompt: Prompt) -> str | None:
        return None

    def respond(self, text: str) -> str | None:
        self.heard += 1
        time.sleep(1.0)
        return None if self.heard >= 4 else f"More ({self.heard}).\n"

    def get_reward(self) -> float:
        return 1.0 if self.heard >= 4 else 0.0
