"""`sparkrl eval`: a model on held-out countdown problems — n samples per problem at a temperature, greedy
accuracy, pass@1 and the unbiased pass@k estimator (Chen et al. 2021: 1 − C(n−c, k) / C(n, k) per problem,
averaged).

The held-out split is the countdown generator seeded per problem with `heldout-<i>` strings, a seed range
the training feeder (an integer-seeded stream) and the tiny model's warm-up (`eval-…`, `final-…`) never
use; the problems come from the same distribution, so a problem's numbers can coincide with a training
one's. Prompts go through the model's chat template, as a rollout worker's do; answers are scored by the
same verifier as the reward service's countdown task. Generation is the torch engine's.
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sparkrl.services.common.countdown import (
    CountdownProblem,
    format_prompt,
    generate_problem,
    score_countdown,
)
from sparkrl.services.common.modeling import apply_chat_template_if_any
from sparkrl.services.common.settings import SamplingSettings, TorchEngineSettings

CHUNK_PROMPTS = 32  # problems generated together (× n rows)


@dataclass(frozen=True)
class EvalResult:
    model: str
    problems: int
    n: int
    temperature: float
    greedy: float  # accuracy of the most likely answer (argmax decoding)
    pass_at: dict[int, float]  # k → unbiased pass@k
    seconds: float

    def table(self) -> str:
        rows = [f"  greedy   {self.greedy:.3f}"]
        rows += [f"  pass@{k:<4d} {v:.3f}" for k, v in self.pass_at.items()]
        head = f"{self.model}: {self.problems} held-out countdown problems"
        head += f", {self.n} samples at T={self.temperature:g}"
        return "\n".join([head, *rows])

    def as_json(self) -> dict[str, object]:
        return {
            "model": self.model,
            "task": "countdown",
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


def heldout_countdown(count: int) -> list[CountdownProblem]:
    return [generate_problem(random.Random(f"heldout-{i}")) for i in range(count)]


def resolve_model(path: Path) -> Path:
    """A model directory as given, a checkpoint's (`…/step-N` → `hf/`), or a run's latest checkpoint."""
    for candidate in (path, path / "hf"):
        if (candidate / "config.json").is_file():
            return candidate
    latest = path / "checkpoints" / "latest"
    if latest.is_file():
        hf = path / "checkpoints" / latest.read_text().strip() / "hf"
        if (hf / "config.json").is_file():
            return hf
    raise FileNotFoundError(
        f"{path}: no model here (config.json), nor a checkpoint's hf/, nor a run's checkpoints/latest"
    )


def evaluate(
    path: Path,
    problems: int = 256,
    n: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 24,
    seed: int = 0,
    threads: int | None = None,
    tasks: list[CountdownProblem] | None = None,
) -> EvalResult:
    """`tasks`: these problems instead of the held-out split's first `problems`."""
    from sparkrl.services.rollout.torch_engine import TorchEngine  # torch only when evaluating

    started = time.perf_counter()
    model_dir = resolve_model(path)
    engine = TorchEngine(model_dir, TorchEngineSettings(threads=threads, max_batch_sequences=256))
    try:
        tasks = tasks if tasks is not None else heldout_countdown(problems)
        problems = len(tasks)
        prompts = [apply_chat_template_if_any(engine.tokenizer, format_prompt(p)) for p in tasks]
        sampled = SamplingSettings(
            n=n, temperature=temperature, max_new_tokens=max_new_tokens, topk_logprobs=1
        )
        # top_p this small keeps only the most likely token: argmax decoding through the same engine.
        greedy = SamplingSettings(n=1, top_p=1e-9, max_new_tokens=max_new_tokens, topk_logprobs=1)
        correct, greedy_correct = [], 0
        for start in range(0, problems, CHUNK_PROMPTS):
            chunk = slice(start, start + CHUNK_PROMPTS)
            chunk_seed = sampled.model_copy(update={"seed": seed + start})
            for task, group in zip(tasks[chunk], engine.generate(prompts[chunk], chunk_seed), strict=True):
                correct.append(sum(_solves(task, c.text) for c in group))
            for task, (best,) in zip(tasks[chunk], engine.generate(prompts[chunk], greedy), strict=True):
                greedy_correct += _solves(task, best.text)
            print(f"evaluated {min(start + CHUNK_PROMPTS, problems)}/{problems} problems", file=sys.stderr)
    finally:
        engine.close()
    ks = sorted({1, *(2**i for i in range(1, n.bit_length()) if 2**i <= n), n})
    return EvalResult(
        model=str(model_dir),
        problems=problems,
        n=n,
        temperature=temperature,
        greedy=greedy_correct / problems,
        pass_at={k: sum(pass_at_k(n, c, k) for c in correct) / problems for k in ks},
        seconds=time.perf_counter() - started,
    )


def _solves(task: CountdownProblem, text: str) -> bool:
    return score_countdown(text, list(task.numbers), task.target)[0] == 1.0
