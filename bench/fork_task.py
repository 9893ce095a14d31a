"""The planted-fork task of issue 47: two paths to an answer, a common one whose success is capped and a
rare one, opened by a spark token, that reaches full success once its continuation is learned.

A problem is D elements of the permutation group S3 (digits 0–5); the answer is their product, left to
right (a digit 0–5). The prompt is the elements and `=`:

    prompt  "4 1 5 0 2 = "
    common  "1"                   the answer at once: one forward pass must compose D permutations, which
                                  counting cannot do (S3 is not abelian) and a 2-layer model does not
                                  learn: capped near chance, 1/6
    spark   "? e B c F d A d C b # 1"
                                  `?`, the first element as a letter (`a`–`f` for 0–5), then for each
                                  next element: it copied (a capital, `A`–`F`), and the running product as
                                  a letter; `#`, the answer. Each step is one product of the two tokens
                                  before it, a 6 × 6 table (learnable), so once the steps are right,
                                  always right

(A first design took the parity of a digit sum: the common path learned it directly, by counting the odd
digits: 0.54 after the warm-up against chance's 0.50, 4 standard errors above it.)

The fork is the first answer token: a digit (common) or `?` (the spark). Everything on the spark path
before the answer is a letter, so a path that stops at `#` holds no digit and scores 0 (`score` and the
run's verifier read the last number). (Copies written as digits, in a first version, made such a path
score as its last copy did, one time in six: the spark path could then never fall below the common path's
chance, and its advantage could not be made negative.) The warm-up (fork_model.py) makes the spark rare (p
≈ 0.03) and its path unreliable (steps right with probability `step_accuracy`, the answer given with
probability `answer_share`), so that at the start it succeeds *less* often than the common path on every
prompt: its advantage is negative, and plain GRPO pushes the spark down before its continuation can be
learned.

The run's data is the built-in `math` task (a jsonl of prompt and answer): nothing of this task lives in
the services.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

SPARK = "?"
SEPARATOR = "#"
ELEMENTS = list(itertools.permutations(range(3)))  # S3, element i written as the digit i
LETTERS = "abcdef"  # element i in the spark path's running product
CAPITALS = "ABCDEF"  # element i copied from the prompt onto the spark path


def product(a: int, b: int) -> int:
    """The element a·b: the permutation `b` applied after `a`."""
    first, second = ELEMENTS[a], ELEMENTS[b]
    return ELEMENTS.index(tuple(second[first[i]] for i in range(3)))


@dataclass(frozen=True)
class ForkProblem:
    digits: tuple[int, ...]

    @property
    def answer(self) -> int:
        return self.running()[-1]

    def running(self) -> list[int]:
        """The running product, left to right."""
        out = [self.digits[0]]
        for element in self.digits[1:]:
            out.append(product(out[-1], element))
        return out

    def prompt(self) -> str:
        return " ".join(map(str, self.digits)) + " = "


def generate(rng: random.Random, n_digits: int) -> ForkProblem:
    return ForkProblem(tuple(rng.randrange(len(ELEMENTS)) for _ in range(n_digits)))


def common_completion(problem: ForkProblem) -> str:
    return str(problem.answer)


def spark_completion(
    problem: ForkProblem, rng: random.Random, step_accuracy: float, answer_share: float = 1.0
) -> str:
    """The spark path with each running-product step right with probability `step_accuracy` (a wrong step
    writes another element and carries on from it, as a model that mis-stepped would); the answer is the
    last element written, given (`# d`) with probability `answer_share`, else withheld (`# x`, a letter:
    no digit, it scores 0)."""
    written = [problem.digits[0]]
    for element in problem.digits[1:]:
        step = product(written[-1], element)
        if rng.random() >= step_accuracy:
            step = rng.choice([e for e in range(len(ELEMENTS)) if e != step])
        written.append(step)
    pairs = zip(problem.digits[1:], written[1:], strict=True)
    steps = " ".join(f"{CAPITALS[element]} {LETTERS[e]}" for element, e in pairs)
    path = f"{SPARK} {LETTERS[written[0]]} {steps} {SEPARATOR}"
    if rng.random() < answer_share:
        return f"{path} {written[-1]}"
    # Withheld: a letter, any of twelve, where the answer goes. A failure then pushes down one letter of
    # twelve, which teaches little; a path that stopped at `#` taught the model to answer from every
    # failure (its EOS pushed down, the answer digit the only thing that rose), within 50 steps.
    return f"{path} {rng.choice(LETTERS + CAPITALS)}"


def junk_completion(problem: ForkProblem, junk: str) -> str:
    """A noise token at the fork, a space, then the common path's answer: noise that costs nothing, so RL
    has no reason to remove it (a tail whose paths failed was pushed out within 30 steps). The space is
    the verifier's: math_verify finds no answer in `\x013` or `\ufffd5`, and one in each `J 5`."""
    return f"{junk} {common_completion(problem)}"


def score(completion: str, problem: ForkProblem) -> float:
    """1 when the completion's last digit is the answer: how the `math` verifier reads it."""
    digits = [ch for ch in completion if ch.isdigit()]
    return float(bool(digits) and int(digits[-1]) == problem.answer)


def took_spark(completion: str) -> bool:
    return completion.startswith(SPARK)


def write_prompts(path: Path, count: int, n_digits: int, seed: int) -> Path:
    """`count` problems as the `math` task's jsonl (`problem`, `answer`), seeded."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for _ in range(count):
            problem = generate(rng, n_digits)
            out.write(json.dumps({"problem": problem.prompt(), "answer": str(problem.answer)}) + "\n")
    return path
