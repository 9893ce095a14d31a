"""Held-out evaluation of multi-turn tasks (issue 48, item 5): with `rollout.agent` set, a problem's
samples are episodes, played with the run's environment exactly as the workers play them
(agent_loop.play: the same limits, template and tools), and pass@k is over episodes.

An episode solves its problem when what would train on it has full marks: the verifier's verdict on the
model's last turn is `correct` (rollout.agent.reward verifier), the environment's reward is at least 1
(environment), or the sum's verdict is (sum) — `batch.episode_results`, the workers' rule. A problem the
environment refuses to start counts as unsolved in every sample (said in the log); greedy is one episode
decoded by argmax.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sparkrl.proto import Prompt
from sparkrl.services.common.environments import Session
from sparkrl.services.common.settings import PromptFormat, SamplingSettings
from sparkrl.services.common.settings.rollout import AgentSettings
from sparkrl.services.common.tasks.evaluation import (
    CHUNK_PROMPTS,
    EvalResult,
    pass_at_k,
    reported_ks,
)
from sparkrl.services.rollout.agent_loop import EpisodeRun, play
from sparkrl.services.rollout.engine import Engine

log = logging.getLogger("sparkrl.evaluator")

# (problems, each problem's episodes) → whether each episode solved its problem, in order
EpisodeScorer = Callable[[list[Prompt], list[list[EpisodeRun]]], list[bool]]


def evaluate_episodes(
    engine: Engine,
    tasks: list[Prompt],
    score: EpisodeScorer,
    agent: AgentSettings,
    fmt: PromptFormat,
    sampled: SamplingSettings,
    open_session: Callable[[], Session] | None = None,
) -> EvalResult:
    """`sampled.n` episodes of each problem at `sampled`'s temperature and one greedy, scored by `score`."""
    if not tasks:
        raise ValueError("no problems to evaluate")
    started, n = time.perf_counter(), sampled.n
    greedy = sampled.model_copy(update={"n": 1, "top_p": 1e-9})  # argmax through the same engine
    correct: list[int] = []
    greedy_correct = 0
    for start in range(0, len(tasks), CHUNK_PROMPTS):
        chunk = tasks[start : start + CHUNK_PROMPTS]
        runs = _played(engine, chunk, sampled.model_copy(update={"seed": sampled.seed + start}), agent, fmt,
                       open_session)  # fmt: skip
        solved = iter(score(chunk, runs))
        correct += [sum(next(solved) for _ in group) for group in runs]
        greedy_correct += sum(score(chunk, _played(engine, chunk, greedy, agent, fmt, open_session)))
    count = len(tasks)
    return EvalResult(
        model="",
        task=tasks[0].task,
        problems=count,
        n=n,
        temperature=sampled.temperature,
        greedy=greedy_correct / count,
        pass_at={k: sum(pass_at_k(n, c, k) for c in correct) / count for k in reported_ks(n)},
        seconds=time.perf_counter() - started,
    )


def _played(
    engine: Engine,
    tasks: list[Prompt],
    sampling: SamplingSettings,
    agent: AgentSettings,
    fmt: PromptFormat,
    open_session: Callable[[], Session] | None,
) -> list[list[EpisodeRun]]:
    """Each problem's episodes; none for a problem the environment refused (said)."""
    runs, refused = play(engine, tasks, sampling, agent, fmt, open_session)
    for index, why in refused.items():
        log.warning("held-out problem %s refused by the environment, counted unsolved: %s",
                    tasks[index].prompt_id, why)  # fmt: skip
    return runs
