"""Tools a model calls in an episode (issue 48, items 1–2): how an in-process environment offers them,
how a call is read from the model's text, and the two that ship.

- **An environment's tools** are its public methods with type hints and a Google-style docstring (TRL's
  `environment_factory` shape, so an OpenEnv/TRL environment ports with a few lines): `tool_schemas`
  gives their JSON schemas (transformers' `get_json_schema`, what `apply_chat_template(tools=…)` takes),
  `reset`, `respond` and `get_reward` are not tools.
- **A call** is a `<tool_call>{"name": …, "arguments": {…}}</tool_call>` block in the model's turn (the
  Hermes / Qwen format): `parse_tool_calls` returns each call, or for a malformed one the reason.
- **`call_tool` never raises**: an unknown tool, arguments that do not fit its signature, a malformed
  call or the tool's own exception become an observation, text the model sees in the next turn, with
  a named status (`ok`, `malformed`, `unknown_tool`, `bad_arguments`, `tool_error`, and the sandbox's
  `timeout` / `cpu_limit` / `killed` for the Python tool).
- **Shipped**: `calculator` (arithmetic by walking the expression's syntax tree: no `eval`) and `python`
  (the code run in `sandbox.run_python`: its own uid, namespaces and limits).
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_type_hints

from transformers.utils import get_json_schema

from sparkrl.services.common.sandbox import SandboxLimits, run_python

NOT_TOOLS = frozenset({"reset", "get_reward", "respond"})  # the environment's own methods, never tools
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_OBSERVATION = 4_000  # characters of a tool's answer the model sees


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Observation:
    status: str  # ok, malformed, unknown_tool, bad_arguments, tool_error, timeout, cpu_limit, killed
    text: str


def tools_of(environment: object) -> dict[str, Callable[..., Any]]:
    """The environment's tools: public methods, `reset`, `respond` and `get_reward` aside."""
    return {
        name: member
        for name, member in inspect.getmembers(environment, inspect.ismethod)
        if not name.startswith("_") and name not in NOT_TOOLS
    }


def tool_schemas(environment: object) -> list[dict[str, Any]]:
    """Each tool's JSON schema, from its type hints and docstring (a tool without them is an error that
    names it, raised when the environment is set up, not mid-episode)."""
    schemas = []
    for name, tool in sorted(tools_of(environment).items()):
        try:
            schemas.append(get_json_schema(tool))
        except Exception as exc:  # transformers' own errors for a missing hint or docstring
            raise ValueError(
                f"tool {name!r} of {type(environment).__name__} needs type hints and a docstring that "
                f"describes each argument (Google style, `Args:`): {exc}"
            ) from exc
    return schemas


def parse_tool_calls(text: str) -> list[ToolCall | Observation]:
    """The calls in a model's turn, in order; a block that is not `{"name": str, "arguments": {…}}` is
    an Observation saying what was wrong."""
    calls: list[ToolCall | Observation] = []
    for block in CALL.findall(text):
        try:
            data = json.loads(block)
        except json.JSONDecodeError as exc:
            calls.append(Observation("malformed", f"the tool call is not JSON: {exc.msg} at {exc.pos}"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(Observation("malformed", 'a tool call is {"name": ..., "arguments": {...}}'))
            continue
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # some templates write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                calls.append(Observation("malformed", f"the arguments of {data['name']!r} are a string "
                                         f"that is not JSON: {exc.msg} at {exc.pos}"))  # fmt: skip
                continue
        if not isinstance(arguments, dict):
            calls.append(Observation("malformed", f"the arguments of {data['name']!r} are not an object"))
            continue
        calls.append(ToolCall(data["name"], arguments))
    return calls


def call_tool(environment: object, call: ToolCall | Observation) -> Observation:
    """Run one call against the environment's tools; whatever happens, an Observation."""
    if isinstance(call, Observation):
        return call
    tools = tools_of(environment)
    tool = tools.get(call.name)
    if tool is None:
        return Observation("unknown_tool", f"no tool {call.name!r}; the tools are {sorted(tools)}")
    wrong = _wrong_arguments(tool, call.arguments)
    if wrong:
        return Observation("bad_arguments", f"{call.name}: {wrong}")
    try:
        result = tool(**call.arguments)
    except Exception as exc:
        return Observation("tool_error", f"{call.name} failed: {type(exc).__name__}: {exc}"[:MAX_OBSERVATION])
    if isinstance(result, Observation):
        return result
    return Observation("ok", str(result)[:MAX_OBSERVATION])


_KINDS: dict[Any, tuple[type, ...]] = {str: (str,), int: (int,), float: (int, float), bool: (bool,)}


def _wrong_arguments(tool: Callable[..., Any], arguments: dict[str, Any]) -> str | None:
    """What does not fit the tool's signature (missing, unexpected, a number for a string…), or None."""
    try:
        inspect.signature(tool).bind(**arguments)
    except TypeError as exc:
        return str(exc)
    hints = get_type_hints(tool)
    for name, value in arguments.items():
        kinds = _KINDS.get(hints.get(name))
        if kinds and (not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool))):
            return f"argument {name!r} must be {hints[name].__name__}, got {type(value).__name__}"
    return None


_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip
MAX_POWER = 1_000  # an exponent past it is refused: 9**9**9 would take the worker's CPU
MAX_BITS = 100_000  # nor any integer longer (about 30,000 digits): (10**1000)**1000 is refused too


def _bits(value: float | int) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def calculate(expression: str) -> float | int:
    """Arithmetic on numbers (+ − × ÷ // % ** and parentheses), by walking the syntax tree."""

    def walk(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and (
                abs(right) > MAX_POWER or _bits(left) * abs(right) > MAX_BITS
            ):
                raise ValueError(f"{ast.unparse(node)!r} is too large to compute")
            value = _OPERATORS[type(node.op)](left, right)
            if _bits(value) > MAX_BITS:
                raise ValueError(f"{ast.unparse(node)!r} is too large to compute")
            return value
        raise ValueError(f"{ast.unparse(node)!r} is not arithmetic on numbers")

    value = walk(ast.parse(expression, mode="eval"))
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    return value


class Calculator:
    """The shipped calculator tool, as an environment method set."""

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers with + - * / // % ** and parentheses, e.g. (3 + 4) * 2.
        """
        return str(calculate(expression))


class PythonInterpreter:
    """The shipped Python tool: each call in its own sandbox (services/common/sandbox.py)."""

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()

    def python(self, code: str) -> Observation:
        """Run Python code and see what it prints.

        Args:
            code: A Python program; what it prints to stdout and stderr is the answer.
        """
        done = run_python(code, self.limits)
        said = done.stdout + (f"\n[stderr]\n{done.stderr}" if done.stderr else "")
        if done.truncated:
            said += f"\n[output cut at {self.limits.output_bytes} bytes a stream]"
        if done.status in ("timeout", "cpu_limit", "killed"):
            said += f"\n[{done.status}: stopped after {done.seconds:.1f} s]"
        status = "tool_error" if done.status == "error" else done.status
        return Observation(status, said[:MAX_OBSERVATION])
