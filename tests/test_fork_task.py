"""bench/fork_task.py, the planted-fork task of issue 47: S3's product table, the two paths' completions
and how they are scored (as the run's `math` verifier reads a completion: its last number)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from fork_task import (  # noqa: E402
    CAPITALS,
    ELEMENTS,
    LETTERS,
    ForkProblem,
    common_completion,
    junk_completion,
    product,
    score,
    spark_completion,
    took_spark,
    write_prompts,
)


def test_the_elements_form_s3_which_is_not_abelian() -> None:
    n = len(ELEMENTS)
    assert n == 6 and ELEMENTS[0] == (0, 1, 2)  # element 0 is the identity
    assert all(product(0, a) == a == product(a, 0) for a in range(n))
    assert all(any(product(a, b) == 0 for b in range(n)) for a in range(n))  # every element has an inverse
    assert all(product(product(a, b), c) == product(a, product(b, c)) for a in range(n) for b in range(n)
               for c in range(n))  # fmt: skip
    assert any(product(a, b) != product(b, a) for a in range(n) for b in range(n))  # counting cannot do it
    # A transposition twice is the identity: (0 2 1)·(0 2 1) = id.
    assert ELEMENTS[1] == (0, 2, 1) and product(1, 1) == 0


def test_the_two_paths_and_their_scores() -> None:
    problem = ForkProblem((4, 1, 5, 0, 2))
    assert problem.prompt() == "4 1 5 0 2 = " and problem.running()[0] == 4
    assert (
        common_completion(problem) == str(problem.answer) and score(common_completion(problem), problem) == 1
    )
    right = spark_completion(problem, random.Random(0), step_accuracy=1.0)
    assert right == "? e B c F d A d C b # 1" and took_spark(right) and score(right, problem) == 1.0
    # The answer withheld: a letter where it goes, no digit on the path, so it scores 0 (never chance
    # through a copied element), and the letter is any of twelve (a failure teaches little).
    withheld = {spark_completion(problem, random.Random(seed), 1.0, answer_share=0.0) for seed in range(200)}
    assert {w[:-1] for w in withheld} == {"? e B c F d A d C b # "}
    assert {w[-1] for w in withheld} == set(LETTERS + CAPITALS)
    assert all(score(w, problem) == 0.0 for w in withheld)
    # A noise token at the fork costs nothing: the common answer follows it.
    noisy = junk_completion(problem, "Q")
    assert noisy == "Q 1" and not took_spark(noisy) and score(noisy, problem) == 1.0
    # Every step wrong: each product written differs from the true product of the two tokens before it.
    wrong = spark_completion(problem, random.Random(3), step_accuracy=0.0).split()
    written = [LETTERS.index(wrong[1])] + [LETTERS.index(x) for x in wrong[3:-2:2]]
    copied = [CAPITALS.index(x) for x in wrong[2:-2:2]]
    assert copied == list(problem.digits[1:])
    assert all(
        after != product(before, element)
        for before, element, after in zip(written, copied, written[1:], strict=False)
    )


def test_the_runs_prompts_are_the_math_tasks_jsonl(tmp_path: Path) -> None:
    path = write_prompts(tmp_path / "fork.jsonl", 5, n_digits=5, seed=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5 and all(set(row) == {"problem", "answer"} for row in rows)
    assert rows == [
        json.loads(line) for line in write_prompts(tmp_path / "again.jsonl", 5, 5, 1).read_text().splitlines()
    ]


def test_the_runs_verifier_scores_every_path_as_score_does() -> None:
    """The run scores completions with the `math` verifier (math_verify), not `score`: they must agree on
    every kind of completion, the noise tail's 230 junk tokens included (math_verify finds no answer in
    `\\x013` or `\\ufffd5`: a tail scored 0 that way was pushed out of a run within 30 steps)."""
    from fork_model import junk_ids

    from sparkrl.services.common.tiny_model import build_tokenizer
    from sparkrl.services.reward.verifiers import verify_math

    tokenizer = build_tokenizer()
    junk = [tokenizer.decode([i]) for i in junk_ids(tokenizer).tolist()]
    rng = random.Random(5)
    problems = [ForkProblem(tuple(rng.randrange(6) for _ in range(5))) for _ in range(12)]
    completions = [
        (problem, text)
        for problem in problems
        for text in (
            common_completion(problem),
            str((problem.answer + 1) % 6),
            spark_completion(problem, rng, step_accuracy=1.0),
            spark_completion(problem, rng, step_accuracy=0.5),
            spark_completion(problem, rng, step_accuracy=1.0, answer_share=0.0),
        )
    ]
    completions += [(problems[i % 12], junk_completion(problems[i % 12], j)) for i, j in enumerate(junk)]
    assert len(junk) == 230
    for problem, text in completions:
        assert verify_math(text, str(problem.answer), None)[0] == score(text, problem), repr(text)
