"""Countdown: generator solvable by construction, random solutions valid, a safe and exact scorer."""

from __future__ import annotations

import random
import time

import pytest

from sparkrl.services.common.tasks.countdown import (
    MAX_DEPTH,
    CountdownProblem,
    format_prompt,
    generate_problem,
    random_solution,
    score_countdown,
)


def test_generated_problems_are_solvable_and_bounded() -> None:
    rng = random.Random(0)
    for _ in range(300):
        problem = generate_problem(rng)
        assert 2 <= len(problem.numbers) <= 3
        assert all(1 <= x <= 9 for x in problem.numbers)
        assert 1 <= problem.target <= 100 and problem.target not in problem.numbers
        solution = random_solution(problem, rng)
        assert score_countdown(solution, list(problem.numbers), problem.target)[:2] == (1.0, "correct")


def test_generator_is_deterministic_and_takes_parameters() -> None:
    first = [generate_problem(random.Random(7)) for _ in range(3)]
    assert first == [generate_problem(random.Random(7)) for _ in range(3)]
    hard = generate_problem(random.Random(1), min_count=4, max_count=5, max_number=50, max_target=500)
    assert 4 <= len(hard.numbers) <= 5 and hard.target <= 500
    with pytest.raises(ValueError):
        generate_problem(random.Random(0), min_count=1)


def test_random_solution_has_many_paths() -> None:
    problem = CountdownProblem(numbers=(2, 3, 4), target=10)
    solutions = {random_solution(problem, random.Random(seed)) for seed in range(40)}
    assert len(solutions) >= 3
    for solution in solutions:
        assert score_countdown(solution, [2, 3, 4], 10)[1] == "correct"
    with pytest.raises(ValueError):
        random_solution(CountdownProblem(numbers=(1, 1), target=97), random.Random(0))


def test_prompt_names_numbers_and_target() -> None:
    assert format_prompt(CountdownProblem(numbers=(3, 7), target=21)) == "Use 3 7 to make 21.\n"


@pytest.mark.parametrize(
    ("completion", "numbers", "target", "status"),
    [
        ("(1+2)*3", [1, 2, 3], 9, "correct"),
        ("  3 * (2 + 1) = 9\nsome explanation", [1, 2, 3], 9, "correct"),  # first line, left of `=`
        ("2*5", [2, 5, 9], 10, "correct"),  # not every number is needed
        ("(1/3+1)*3", [1, 3, 1, 3], 4, "correct"),  # exact rational intermediate
        ("1+1", [1, 2], 2, "incorrect"),  # a number used twice, given once
        ("4+4", [4, 4], 8, "correct"),  # given twice: may be used twice
        ("7+1", [1, 2], 8, "incorrect"),  # a number not given
        ("1+2", [1, 2], 4, "incorrect"),  # wrong value
        ("3/(2-2)", [2, 2, 3], 1, "incorrect"),  # division by zero
        ("-1+3", [1, 3], 2, "incorrect"),  # no unary minus
        ("1 2", [1, 2], 3, "incorrect"),
        ("(1+2", [1, 2], 3, "incorrect"),
        ("1+2)", [1, 2], 3, "incorrect"),
        ("1+", [1], 1, "incorrect"),
        ("The answer is 1+2", [1, 2], 3, "no_answer"),  # letters
        ("1+2.0", [1, 2], 3, "no_answer"),
        ("", [1, 2], 3, "no_answer"),
        ("= 3", [1, 2], 3, "no_answer"),
        ("\n1+2", [1, 2], 3, "no_answer"),  # the answer must be on the first line
    ],
)
def test_score_cases(completion: str, numbers: list[int], target: int, status: str) -> None:
    score, got, detail = score_countdown(completion, numbers, target)
    assert (got, score) == (status, 1.0 if status == "correct" else 0.0), detail
    assert detail


def test_division_by_zero_and_reuse_details() -> None:
    assert "division by zero" in score_countdown("3/(2-2)", [2, 2, 3], 1)[2]
    assert "[1]" in score_countdown("1+1", [1, 2], 2)[2]


def test_huge_and_deep_inputs_are_bounded() -> None:
    start = time.perf_counter()
    huge = score_countdown("1+" * 5_000_000 + "1", [1], 1)
    deep = score_countdown("(" * 100 + "1" + ")" * 100, [1], 1)
    just_deep_enough = score_countdown("(" * MAX_DEPTH + "1" + ")" * MAX_DEPTH, [1], 1)
    no_newline_garbage = score_countdown("x" * 10_000_000, [1], 1)
    assert time.perf_counter() - start < 2.0
    assert huge[1] == "incorrect" and "longer" in huge[2]
    assert deep[1] == "incorrect"
    assert just_deep_enough[1] == "correct"
    assert no_newline_garbage[1] == "incorrect"  # over the length bound before any character check
