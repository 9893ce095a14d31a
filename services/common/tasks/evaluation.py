"""Held-out evaluation, shared by `sparkrl eval` and the in-training evaluator: n samples per problem at a
temperature, greedy accuracy, pass@1 and the unbiased pass@k estimator (Chen et al. 2021: 1 − C(n−c, k) /
C(n, k) per problem, averaged).

Problems are `Prompt`s, as the training stream carries them: the countdown held-out split (the generator
seeded per problem with `heldout-<i>` strings, a seed range the training feeder — an integer-seeded
stream — and the tiny model's warm-up — `eval-…`, `final-…` — never use; same distribution, so a
problem's numbers can coincide with a training one's), or the rows of a math benchmark file. Prompts are
rendered as a rollout worker's are (`modeling.render_prompt` in the run's `PromptFormat`); whoever calls
decides how answers are scored (the reward service's verifiers, in-process or over HTTP). Generation is
the engine's.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sparkrl.proto import Prompt
from sparkrl.services.common.modeling import render_prompt
from sparkrl.services.common.settings import CountdownSettings, PromptFormat, SamplingSettings
from sparkrl.services.common.tasks.countdown import format_prompt, generate_problem

CHUNK_PROMPTS = 32  # problems generated together (× n rows)

# (problems, one completion text per problem) → whether each is correct
Scorer = Callable[[list[Prompt], list[str]], list[bool]]


class _Engine(Protocol):  # the rollout engines' generate() and tokenizer; common code imports no service
    tokenizer: Any

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[list[Any]]: ...


@dataclass(frozen=True)
class EvalResult:
    model: str
    task: str
    problems: int
    n: int
    temperature: float
    greedy: float  # accuracy of the most likely answer (argmax decoding)
    pass_at: dict[int, float]  # k → unbiased pass@k
    seconds: float

    def table(self) -> str:
        rows = [f"  greedy   {self.greedy:.3f}"]
        rows += [f"  pass@{k:<4d} {v:.3f}" for k, v in self.pass_at.items()]
        head = f"{self.model}: {self.problems} held-out {self.task} problems"
        head += f", {self.n} samples at T={self.temperature:g}"
        return "\n".join([head, *rows])

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "task": self.task,
            "problems": self.problems,
            "n": self.n,
            "temperature": self.temperature,
            "greedy": round(self.greedy, 4),
            **{f"pass@{k}": round(v, 4) for k, v in self.pass_at.items()},
            "seconds": round(self.seconds, 2),
        }


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of P(at least one of k samples is correct) from c correct out of n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 ≤ c ≤ n and 1 ≤ k ≤ n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def reported_ks(n: int) -> list[int]:
    """1, the powers of two up to n, and n."""
    return sorted({1, *(2**i for i in range(1, n.bit_length()) if 2**i <= n), n})


def heldout_countdown(count: int, difficulty: CountdownSettings | None = None) -> list[Prompt]:
    """The first `count` problems of the held-out split, at the training feeder's difficulty."""
    kwargs = (difficulty or CountdownSettings()).model_dump()
    prompts = []
    for i in range(count):
        problem = generate_problem(random.Random(f"heldout-{i}"), **kwargs)
        prompts.append(
            Prompt(
                prompt_id=f"heldout-{i:06d}",
                task="countdown",
                text=format_prompt(problem),
                task_data={"numbers": list(problem.numbers), "target": problem.target},
                source="countdown-heldout",
            )
        )
    return prompts


def evaluate_engine(
    engine: _Engine,
    tasks: list[Prompt],
    score: Scorer,
    n: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 24,
    seed: int = 0,
    model: str = "",
    progress: bool = True,
    *,
    fmt: PromptFormat,
) -> EvalResult:
    """`tasks` rendered in `fmt` (the run's `rollout` chat template, its variables, system prompt), sampled
    n times each at `temperature` and once greedily, scored by `score`."""
    if not tasks:
        raise ValueError("no problems to evaluate")
    started = time.perf_counter()
    prompts = [render_prompt(engine.tokenizer, p.messages or p.text or "", fmt) for p in tasks]
    sampled = SamplingSettings(n=n, temperature=temperature, max_new_tokens=max_new_tokens, topk_logprobs=1)
    # top_p this small keeps only the most likely token: argmax decoding through the same engine.
    greedy = SamplingSettings(n=1, top_p=1e-9, max_new_tokens=max_new_tokens, topk_logprobs=1)
    correct: list[int] = []
    greedy_correct = 0
    for start in range(0, len(tasks), CHUNK_PROMPTS):
        chunk = slice(start, start + CHUNK_PROMPTS)
        chunk_tasks = tasks[chunk]
        chunk_seed = sampled.model_copy(update={"seed": seed + start})
        groups = engine.generate(prompts[chunk], chunk_seed)
        flat_tasks = [task for task in chunk_tasks for _ in range(n)]
        verdicts = score(flat_tasks, [c.text for group in groups for c in group])
        correct += [sum(verdicts[i * n : (i + 1) * n]) for i in range(len(chunk_tasks))]
        best = [group[0].text for group in engine.generate(prompts[chunk], greedy)]
        greedy_correct += sum(score(chunk_tasks, best))
        if progress:
            print(
                f"evaluated {min(start + CHUNK_PROMPTS, len(tasks))}/{len(tasks)} problems", file=sys.stderr
            )
    count = len(tasks)
    return EvalResult(
        model=model,
        task=tasks[0].task,
        problems=count,
        n=n,
        temperature=temperature,
        greedy=greedy_correct / count,
        pass_at={k: sum(pass_at_k(n, c, k) for c in correct) / count for k in reported_ks(n)},
        seconds=time.perf_counter() - started,
    )
