"""Countdown: reach a target with + - * / over given numbers, each used at most once.

Pure logic (no torch): the prompt generator (`sparkrl prompts`), the warm-up data of the tiny model, and
the verifier the reward service imports (`score_countdown`). The scorer never calls `eval`: it parses the
first line of a completion with a bounded recursive-descent parser and evaluates it exactly (Fraction).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

ALLOWED_CHARS = frozenset("0123456789+-*/() ")
MAX_EXPR_CHARS = 256  # longer "answers" are rejected before tokenizing: bounds time and memory
MAX_DEPTH = 32  # parenthesis nesting bound: bounds the parser's recursion
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3  # precedence of a bare number: never needs parentheses


@dataclass(frozen=True)
class CountdownProblem:
    """Numbers to combine and the target to reach."""

    numbers: tuple[int, ...]
    target: int


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction | None:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return None if b == 0 else a / b


def _join(op: str, left: tuple[str, int], right: tuple[str, int]) -> tuple[str, int]:
    """Join two (text, precedence) operands with the fewest parentheses that keep the meaning."""
    prec = _PRECEDENCE[op]
    left_text = f"({left[0]})" if left[1] < prec else left[0]
    # `-` and `/` are not associative: a right operand of the same precedence needs parentheses.
    right_needs = right[1] < prec or (right[1] == prec and op in "-/")
    right_text = f"({right[0]})" if right_needs else right[0]
    return f"{left_text}{op}{right_text}", prec


def _random_expression(numbers: list[int], rng: random.Random) -> tuple[str, Fraction | None]:
    """A random expression tree over all of `numbers` (in the given order of leaves)."""
    items: list[tuple[tuple[str, int], Fraction | None]] = [((str(x), _ATOM), Fraction(x)) for x in numbers]
    while len(items) > 1:
        i = rng.randrange(len(items) - 1)
        (left, a), (right, b) = items[i], items[i + 1]
        op = rng.choice("+-*/")
        value = None if a is None or b is None else _apply(op, a, b)
        items[i : i + 2] = [(_join(op, left, right), value)]
    return items[0][0][0], items[0][1]


def generate_problem(
    rng: random.Random,
    min_count: int = 2,
    max_count: int = 3,
    max_number: int = 9,
    max_target: int = 100,
) -> CountdownProblem:
    """A problem solvable by construction: the target is the value of a random expression over a subset.

    Difficulty varies on purpose: 2 or 3 numbers, and the hidden expression uses 2 to all of them. The
    defaults are the tiny model's training distribution (single digits keep a character model's job
    learnable in seconds); pass larger values for a harder task.
    """
    if not 2 <= min_count <= max_count:
        raise ValueError(f"need 2 <= min_count <= max_count, got {min_count}, {max_count}")
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(rng.randint(min_count, max_count))]
        subset = rng.sample(numbers, rng.randint(2, len(numbers)))
        _, value = _random_expression(subset, rng)
        # A target equal to a given number is solved by copying it: no arithmetic to learn.
        if value is not None and value.denominator == 1 and 1 <= value <= max_target and value not in numbers:
            return CountdownProblem(numbers=tuple(numbers), target=int(value))


def _search(
    items: list[tuple[tuple[str, int], Fraction]], target: Fraction, rng: random.Random, seen: set
) -> str | None:
    """Randomized depth-first search over pairwise combinations; covers every expression tree."""
    for text, value in items:
        if value == target:
            return text[0]
    if len(items) < 2:
        return None
    key = tuple(sorted(value for _, value in items))
    if key in seen:
        return None
    seen.add(key)
    pairs = [(i, j) for i in range(len(items)) for j in range(len(items)) if i != j]
    rng.shuffle(pairs)
    for i, j in pairs:
        ops = list("+-*/")
        rng.shuffle(ops)
        rest = [item for k, item in enumerate(items) if k not in (i, j)]
        for op in ops:
            if op in "+*" and i > j:
                continue  # commutative: the (j, i) pair covers it
            value = _apply(op, items[i][1], items[j][1])
            if value is None:
                continue
            found = _search([*rest, (_join(op, items[i][0], items[j][0]), value)], target, rng, seen)
            if found is not None:
                return found
    return None


def random_solution(problem: CountdownProblem, rng: random.Random) -> str:
    """A random correct expression (many solution paths exist; the search order is random)."""
    items = [((str(x), _ATOM), Fraction(x)) for x in problem.numbers]
    rng.shuffle(items)
    found = _search(items, Fraction(problem.target), rng, set())
    if found is None:
        raise ValueError(f"no solution for {problem}")
    return found


def format_prompt(problem: CountdownProblem) -> str:
    """Plain text a character-level model can learn; the completion is the bare expression, then EOS."""
    numbers = " ".join(str(x) for x in problem.numbers)
    return f"Use {numbers} to make {problem.target}.\n"


class _ParseError(ValueError):
    """The completion's first line is not an arithmetic expression over integers."""


class _Parser:
    """expr := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*; factor := NUMBER | '(' expr ')'."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0
        self.used: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise _ParseError("unexpected end of expression")
        self.pos += 1
        return token

    def expr(self) -> Fraction | None:
        value = self.term()
        while self.peek() in ("+", "-"):
            op, right = self.take(), self.term()
            value = None if value is None or right is None else _apply(op, value, right)
        return value

    def term(self) -> Fraction | None:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op, right = self.take(), self.factor()
            # Division by zero poisons the value (None) but parsing continues, so the number-use check
            # still sees the whole expression.
            value = None if value is None or right is None else _apply(op, value, right)
        return value

    def factor(self) -> Fraction | None:
        token = self.take()
        if token == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise _ParseError(f"parentheses nested deeper than {MAX_DEPTH}")
            value = self.expr()
            if self.take() != ")":
                raise _ParseError("missing ')'")
            self.depth -= 1
            return value
        if token.isdigit():
            self.used.append(int(token))
            return Fraction(int(token))
        raise _ParseError(f"unexpected {token!r}")


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == " ":
            i += 1
        elif ch.isdigit():
            j = i
            while j < len(text) and text[j].isdigit():
                j += 1
            tokens.append(text[i:j])
            i = j
        else:
            tokens.append(ch)
            i += 1
    return tokens


def extract_expression(completion: str) -> str:
    """The answer: the first line of the completion, left of an optional `=`, stripped."""
    newline = completion.find("\n")
    first_line = completion if newline < 0 else completion[:newline]
    return first_line.partition("=")[0].strip()


def score_countdown(completion: str, numbers: list[int], target: int) -> tuple[float, str, str]:
    """(score, status, detail): 1.0 "correct" iff the expression uses each given number at most once and
    evaluates exactly to `target`; "no_answer" when there is nothing to check; "incorrect" otherwise."""
    expression = extract_expression(completion)
    if not expression:
        return 0.0, "no_answer", "empty answer"
    if len(expression) > MAX_EXPR_CHARS:
        return 0.0, "incorrect", f"expression longer than {MAX_EXPR_CHARS} characters"
    bad = sorted(set(expression) - ALLOWED_CHARS)
    if bad:
        return 0.0, "no_answer", f"characters outside digits, + - * / ( ) and space: {''.join(bad)!r}"
    parser = _Parser(_tokenize(expression))
    try:
        value = parser.expr()
        if parser.peek() is not None:
            raise _ParseError(f"unexpected {parser.peek()!r}")
    except _ParseError as err:
        return 0.0, "incorrect", f"{expression!r}: syntax error: {err}"
    overused = Counter(parser.used) - Counter(numbers)
    if overused:
        extra = sorted(overused.elements())
        return 0.0, "incorrect", f"{expression!r}: uses numbers not given, or too often: {extra}"
    if value is None:
        return 0.0, "incorrect", f"{expression!r}: division by zero"
    if value != target:
        return 0.0, "incorrect", f"{expression!r} = {value}, target {target}"
    return 1.0, "correct", f"{expression!r} = {target}"
