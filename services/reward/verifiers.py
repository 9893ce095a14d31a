"""The verifier registry: task name → `verify(completion, answer, task_data) -> (score, status, detail)`.

Verifiers run inside the pool's worker processes (see `pool.py`), never on the service's event loop, so a
verifier may be slow or hang: the pool kills it at the item's deadline. Verifiers must therefore be
module-level functions (they travel to the workers pickled by reference) and must not install their own
signal-based timeouts. They signal bad input by raising `ValueError`; `run_verifier` turns any exception
into an `error` result, so one bad item never fails its batch.

One exception: a verifier registered `bounded=True` runs in the service's own process (a thread, off the
event loop), without the round trip to a verifier process, which costs ~10× the verification of a short
answer. Only a verifier whose every step is bounded by limits it checks before any work may say so: it
can neither hang nor run long, so it needs no deadline. Countdown is one (at most `MAX_EXPR_CHARS` of
`+ - * / ( )` and digits on the first line, nested at most `MAX_DEPTH` deep, over at most
`MAX_COUNTDOWN_NUMBERS` numbers within ±`MAX_COUNTDOWN_VALUE`: ~20 µs an answer here, ~0.11 ms at
worst). Math is not (sympy); custom verifiers always run in the pool.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from sparkrl.proto.reward import REWARD_STATUSES
from sparkrl.services.common.tasks.answers import BOX_COMMANDS, last_boxed
from sparkrl.services.common.tasks.countdown import score_countdown

VerifyResult = tuple[float, str, str]
VerifyFn = Callable[[str, str | None, dict[str, Any] | None], VerifyResult]

STATUSES = REWARD_STATUSES
MAX_DETAIL_CHARS = 2000
# Checked before parsing, because sympy/antlr parse time grows steeply with size and nesting (a
# 1,600-character polynomial takes ~3 s, ten nested braces ~2 s, thousands overflow the stack). Real answers
# stay far inside: across MATH-500, AIME24, AMC23, Minerva and OlympiadBench the longest is ~210 characters
# and the deepest nests 4 levels. The pool's per-item deadline still bounds whatever passes these checks.
MAX_ANSWER_CHARS = 1000
MAX_ANSWER_NESTING = 10
# Without a \boxed{}, math_verify's own extraction scans the text; the final answer is near the end, and
# scanning (and sympy-parsing every candidate of) a 200 KB completion would cost seconds.
FALLBACK_TAIL_CHARS = 2000
MAX_COUNTDOWN_NUMBERS = 16
MAX_COUNTDOWN_VALUE = 10**9

_BOLD = re.compile(r"\\textbf\{([^{}]*)\}")
_OPENERS = {"{": "}", "(": ")", "[": "]"}
# Both sides are wrapped as `$\boxed{...}$`, so the box is the anchor; expressions cover `1/2`-style text.
_BOXED_CONFIG = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
_TEXT_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())

_REGISTRY: dict[str, VerifyFn] = {}
_BOUNDED: set[str] = set()


def register_verifier(name: str, fn: VerifyFn, bounded: bool = False) -> None:
    """Add (or replace) a verifier. Register before the pool starts: workers get a snapshot at start.
    `bounded`: it runs in the service's process, not the pool (see the module's docstring)."""
    if not name or len(name) > 64:
        raise ValueError(f"verifier name {name!r} must be 1-64 characters (the wire's `task` field)")
    if not callable(fn):
        raise ValueError(f"verifier {name!r} is not callable: {fn!r}")
    _REGISTRY[name] = fn
    (_BOUNDED.add if bounded else _BOUNDED.discard)(name)


def registry() -> dict[str, VerifyFn]:
    """A snapshot of the registry (what the pool ships to its workers)."""
    return dict(_REGISTRY)


def bounded_tasks() -> frozenset[str]:
    """The tasks whose verifier is registered `bounded`: scored in the service's process."""
    return frozenset(_BOUNDED)


def custom_verifier_name(path: str) -> str:
    """The task a custom verifier `module:function` is registered as: the function's name."""
    return path.partition(":")[2].rsplit(".", 1)[-1]


def load_custom_verifiers(paths: list[str]) -> list[str]:
    """Import each `module:function` and register it under the function's name; returns the names."""
    names = []
    for path in paths:
        module_name, sep, attr = path.partition(":")
        if not sep or not module_name or not attr:
            raise ValueError(f"custom verifier {path!r} is not `module:function`")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"custom verifier {path!r} cannot be loaded: {exc}") from exc
        name = custom_verifier_name(path)
        register_verifier(name, fn)
        names.append(name)
    return names


def run_verifier(
    fn: VerifyFn, completion: str, answer: str | None, task_data: dict[str, Any] | None
) -> VerifyResult:
    """Call a verifier and check what it returns; an exception or a malformed result becomes `error`."""
    try:
        result = fn(completion, answer, task_data)
    except ValueError as exc:
        return 0.0, "error", f"invalid input: {exc}"[:MAX_DETAIL_CHARS]
    except RecursionError:
        return 0.0, "error", "input nests too deeply to parse"
    except Exception as exc:
        return 0.0, "error", f"verifier raised {type(exc).__name__}: {exc}"[:MAX_DETAIL_CHARS]
    if not (isinstance(result, tuple) and len(result) == 3):
        return 0.0, "error", f"verifier returned {type(result).__name__}, not (score, status, detail)"
    score, status, detail = result
    if status not in STATUSES or isinstance(score, bool) or not isinstance(score, (int, float)):
        return 0.0, "error", f"verifier returned an invalid result: {result!r}"[:MAX_DETAIL_CHARS]
    if not math.isfinite(score):
        return 0.0, "error", f"verifier returned a non-finite score {score!r}"
    if status in ("timeout", "error", "unparseable"):
        score = 0.0
    return float(score), status, str(detail)[:MAX_DETAIL_CHARS]


def nesting_depth(text: str) -> int:
    """Deepest nesting of (), [], {} in `text` — an upper bound on the parser's recursion depth."""
    depth = deepest = 0
    for char in text:
        if char in _OPENERS:
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth = max(depth - 1, 0)
    return deepest


def _check_size(what: str, text: str) -> str | None:
    if len(text) > MAX_ANSWER_CHARS:
        return f"{what} is {len(text)} characters (limit {MAX_ANSWER_CHARS})"
    depth = nesting_depth(text)
    if depth > MAX_ANSWER_NESTING:
        return f"{what} nests {depth} levels deep (limit {MAX_ANSWER_NESTING})"
    return None


def _strip_math_delimiters(text: str) -> str:
    text = text.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(text) >= len(left) + len(right) and text.startswith(left) and text.endswith(right):
            return text[len(left) : len(text) - len(right)].strip()
    return text


def _parse_boxed(content: str) -> list[Any]:
    # Bold is typography, and a sentence's full stop is not part of the answer: AoPS-style solutions write
    # `\boxed{\textbf{(073)}}` and `\boxed{104.}`, which math_verify would otherwise read as text.
    content = _BOLD.sub(r"\1", content).strip().rstrip(".").rstrip()
    # parsing_timeout=None: math_verify's own limit is signal.alarm, which the pool's kill replaces.
    return parse(f"$\\boxed{{{content}}}$", extraction_config=_BOXED_CONFIG, parsing_timeout=None)


def parse_gold(answer: str) -> list[Any]:
    """Parse a reference answer given bare (`\\frac{1}{2}`, `10`), in `$...$`, or holding a `\\boxed{}`."""
    text = answer.strip()
    if any(cmd in text for cmd in BOX_COMMANDS):
        text = last_boxed(text) or ""
    text = _strip_math_delimiters(text)
    problem = _check_size("reference answer", text)
    if problem:
        raise ValueError(problem)
    return _parse_boxed(text) if text else []


def extract_prediction(completion: str) -> tuple[list[Any], str]:
    """(parsed answer, the text it came from). Raises ValueError when the answer is too big to parse."""
    boxed = last_boxed(completion)
    if boxed is not None:
        problem = _check_size("boxed answer", boxed)
        if problem:
            raise ValueError(problem)
        return (_parse_boxed(boxed) if boxed.strip() else []), boxed
    if any(cmd in completion for cmd in BOX_COMMANDS):
        return [], "(unclosed \\boxed)"
    tail = completion[-FALLBACK_TAIL_CHARS:]
    if nesting_depth(tail) > MAX_ANSWER_NESTING:
        raise ValueError(f"completion tail nests deeper than {MAX_ANSWER_NESTING} levels")
    parsed = parse(tail, extraction_config=_TEXT_CONFIG, parsing_timeout=None)
    return parsed, (str(parsed[-1]) if parsed else "")


def verify_math(completion: str, answer: str | None, task_data: dict[str, Any] | None) -> VerifyResult:
    """Last `\\boxed{}` of the completion (math_verify's extraction if none) vs the reference answer."""
    if answer is None or not answer.strip():
        raise ValueError("math items need a reference `answer`")
    gold = parse_gold(answer)
    if not gold:
        return 0.0, "error", f"reference answer {answer[:200]!r} could not be parsed"
    try:
        predicted, source = extract_prediction(completion)
    except ValueError as exc:
        return 0.0, "no_answer", str(exc)
    if not predicted:
        return 0.0, "no_answer", f"no answer found {source[:200]!r}" if source else "no answer found"
    # Gold first: math_verify's comparison is not symmetric (intervals, sets, `x=` equations).
    if verify(gold, predicted, timeout_seconds=None):
        return 1.0, "correct", f"answer {source[:200]!r}"
    return 0.0, "incorrect", f"answer {source[:200]!r}, expected {answer[:200]!r}"


def _countdown_task(task_data: dict[str, Any] | None) -> tuple[list[int], int]:
    """Validate countdown's `{"numbers": [int, ...], "target": int}`; ValueError says what is wrong."""
    if not isinstance(task_data, dict):
        raise ValueError('countdown items need task_data {"numbers": [int, ...], "target": int}')
    numbers, target = task_data.get("numbers"), task_data.get("target")
    if not isinstance(numbers, list) or not 1 <= len(numbers) <= MAX_COUNTDOWN_NUMBERS:
        raise ValueError(
            f"task_data.numbers must be a list of 1-{MAX_COUNTDOWN_NUMBERS} integers, got {numbers!r}"
        )
    for field, value in [*(("numbers", n) for n in numbers), ("target", target)]:
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_COUNTDOWN_VALUE:
            raise ValueError(
                f"task_data.{field} must hold integers within ±{MAX_COUNTDOWN_VALUE}, got {value!r}"
            )
    return numbers, target


def verify_countdown(completion: str, answer: str | None, task_data: dict[str, Any] | None) -> VerifyResult:
    """An expression on the completion's first line using each number at most once, equal to the target."""
    numbers, target = _countdown_task(task_data)
    return score_countdown(completion, numbers, target)


def verify_exact(completion: str, answer: str | None, task_data: dict[str, Any] | None) -> VerifyResult:
    """1 iff the completion, stripped, is the answer, stripped (a lookup's secret, a label)."""
    if answer is None:
        return 0.0, "error", "the exact task needs an answer"
    got = completion.strip()
    if not got:
        return 0.0, "no_answer", "empty answer"
    if got == answer.strip():
        return 1.0, "correct", got[:200]
    return 0.0, "incorrect", f"{got[:100]!r}, expected {answer.strip()[:100]!r}"


register_verifier("math", verify_math)
register_verifier("exact", verify_exact, bounded=True)
register_verifier("countdown", verify_countdown, bounded=True)
