"""The verifiers in-process: answer extraction, size guards, countdown's task_data, result checking."""

from __future__ import annotations

from typing import Any

import pytest

from sparkrl.services.common.tasks.answers import last_boxed
from sparkrl.services.reward.verifiers import (
    MAX_ANSWER_CHARS,
    bounded_tasks,
    load_custom_verifiers,
    nesting_depth,
    parse_gold,
    register_verifier,
    registry,
    run_verifier,
    verify_countdown,
    verify_math,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{1} then \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),  # the last box wins
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not close the box
        ("\\boxed{a^{2}+{b}}", "a^{2}+{b}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 5$.", "5"),
        ("\\boxed{1} and \\boxed{2", None),  # the last box never closes: truncated, no answer
        ("no box here", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


def test_nesting_depth() -> None:
    assert nesting_depth("\\frac{1}{2}") == 1
    assert nesting_depth("\\left(\\frac{a^{2}}{b}\\right)") == 3
    assert nesting_depth(")))(") == 1


@pytest.mark.parametrize(
    ("completion", "answer", "status"),
    [
        ("Thus $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", "correct"),
        ("\\boxed{0.5}", "\\frac12", "correct"),
        ("\\boxed{10}", "10", "correct"),
        ("\\boxed{104.}", "104", "correct"),  # a full stop is not part of the answer
        ("\\boxed{\\textbf{(073)}}", "73", "correct"),  # AoPS bold
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "$\\left( 3, \\frac{\\pi}{2} \\right)$", "correct"),
        ("\\boxed{3}", "\\boxed{3}", "correct"),
        ("first \\boxed{2}, finally \\boxed{3}", "2", "incorrect"),
        ("The answer is 42", "42", "correct"),  # no box: math_verify's own extraction
        ("\\boxed{}", "1", "no_answer"),
        ("\\boxed{2", "2", "no_answer"),
    ],
)
def test_verify_math(completion: str, answer: str, status: str) -> None:
    score, got, detail = verify_math(completion, answer, None)
    assert got == status, detail
    assert score == (1.0 if status == "correct" else 0.0)


def test_math_size_guards_refuse_before_parsing() -> None:
    deep = "\\boxed{" + "\\frac{" * 10_000 + "1}{2}" * 10_000 + "}"
    assert verify_math(deep, "1", None)[1:] == ("no_answer", "boxed answer is 110000 characters (limit 1000)")
    nested = "\\boxed{" + "{" * 20 + "1" + "}" * 20 + "}"
    assert "nests 20 levels" in verify_math(nested, "1", None)[2]
    with pytest.raises(ValueError, match="reference answer is 100001 characters"):
        verify_math("\\boxed{1}", "1" * (MAX_ANSWER_CHARS * 100 + 1), None)
    with pytest.raises(ValueError, match="need a reference"):
        verify_math("\\boxed{1}", None, None)
    assert parse_gold("$\\frac{1}{2}$") == parse_gold("\\frac{1}{2}")


@pytest.mark.parametrize(
    ("completion", "task_data", "status"),
    [
        ("(3+5)*3", {"numbers": [3, 5, 3], "target": 24}, "correct"),
        ("3*5+3 = 18\nmore text", {"numbers": [3, 5, 3], "target": 24}, "incorrect"),
        ("8*3", {"numbers": [3, 5, 3], "target": 24}, "incorrect"),  # 8 was not given
        ("", {"numbers": [3, 5], "target": 8}, "no_answer"),
    ],
)
def test_verify_countdown(completion: str, task_data: dict[str, Any], status: str) -> None:
    assert verify_countdown(completion, None, task_data)[1] == status


@pytest.mark.parametrize(
    ("task_data", "message"),
    [
        (None, "countdown items need task_data"),
        ({"target": 24}, "numbers must be a list"),
        ({"numbers": [], "target": 24}, "numbers must be a list"),
        ({"numbers": [1, 2]}, "task_data.target must hold integers"),
        ({"numbers": [1, "2"], "target": 3}, "task_data.numbers must hold integers"),
        ({"numbers": [1, True], "target": 3}, "task_data.numbers must hold integers"),
        ({"numbers": [1, 2], "target": 2.5}, "task_data.target must hold integers"),
    ],
)
def test_countdown_task_data_is_validated(task_data: dict[str, Any] | None, message: str) -> None:
    score, status, detail = run_verifier(verify_countdown, "1+2", None, task_data)
    assert (score, status) == (0.0, "error")
    assert message in detail


def _partial(completion: str, answer: str | None, task_data: dict[str, Any] | None) -> Any:
    return {
        "half": (0.5, "incorrect", "close"),
        "bad_status": (1.0, "great", ""),
        "nan": (float("nan"), "correct", ""),
    }[completion]


def _boom(completion: str, answer: str | None, task_data: dict[str, Any] | None) -> tuple[float, str, str]:
    raise RuntimeError("kaput")


def test_run_verifier_checks_results() -> None:
    assert run_verifier(_partial, "half", None, None) == (0.5, "incorrect", "close")
    assert run_verifier(_partial, "bad_status", None, None)[1] == "error"
    assert run_verifier(_partial, "nan", None, None)[1] == "error"
    assert run_verifier(_boom, "", None, None) == (0.0, "error", "verifier raised RuntimeError: kaput")


def test_registry_and_custom_loading() -> None:
    assert {"math", "countdown"} <= set(registry())
    register_verifier("partial_credit", _partial)
    assert registry()["partial_credit"] is _partial
    with pytest.raises(ValueError, match="not `module:function`"):
        load_custom_verifiers(["no_colon"])
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_custom_verifiers(["sparkrl.services.reward.verifiers:missing"])
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_custom_verifiers(["no_such_module_xyz:fn"])
    with pytest.raises(ValueError, match="1-64 characters"):
        register_verifier("", _partial)


def test_only_a_verifier_registered_bounded_runs_in_the_service() -> None:
    assert "countdown" in bounded_tasks() and "math" not in bounded_tasks()  # sympy can run long
    register_verifier("bounded_credit", _partial, bounded=True)
    assert "bounded_credit" in bounded_tasks()
    register_verifier("bounded_credit", _partial)  # registered again without it: back to the pool
    assert "bounded_credit" not in bounded_tasks()


def test_countdown_scores_the_costliest_input_its_limits_let_through() -> None:
    """What makes countdown bounded: its limits are checked before any work, so the costliest expression
    they admit (under 256 characters, nested 32 deep, the largest numbers multiplied) is still a small
    parse and a few big-integer products. Not timed here (a shared machine); it must score."""
    task_data = {"numbers": [999_999_999] * 16, "target": 1}
    worst = "(" * 32 + "*".join(["999999999"] * 16) + ")" * 32
    assert len(worst) <= 256
    score, status, detail = run_verifier(verify_countdown, worst, None, task_data)
    assert status == "incorrect" and score == 0.0, detail


def test_exact_is_the_answer_verbatim_and_bounded() -> None:
    verify = registry()["exact"]
    assert run_verifier(verify, "  imh\n", "imh", None) == (1.0, "correct", "imh")
    assert run_verifier(verify, "imx", "imh", None)[:2] == (0.0, "incorrect")
    assert run_verifier(verify, "  ", "imh", None)[:2] == (0.0, "no_answer")
    assert run_verifier(verify, "imh", None, None)[:2] == (0.0, "error")
    assert "exact" in bounded_tasks()
