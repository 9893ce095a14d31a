"""services/common/tools.py: an in-process environment's tools (TRL's shape), tool calls read from a
model's turn, and every way a call can go wrong answered as an observation the model sees."""

from __future__ import annotations

import pytest

from sparkrl.services.common.sandbox import SandboxLimits
from sparkrl.services.common.tools import (
    MAX_OBSERVATION,
    Calculator,
    Observation,
    PythonInterpreter,
    ToolCall,
    calculate,
    call_tool,
    parse_tool_calls,
    tool_schemas,
    tools_of,
)


class Shop(Calculator):
    """An environment as TRL writes one: `reset`, tools, `get_reward`."""

    def reset(self) -> str:
        self.basket: list[str] = []
        return "Buy what the list says."

    def add(self, item: str, count: int = 1) -> str:
        """Put items in the basket.

        Args:
            item: What to buy.
            count: How many.
        """
        if item == "unicorn":
            raise LookupError("out of stock")
        self.basket += [item] * count
        return f"{len(self.basket)} in the basket"

    def shout(self) -> str:
        """Say it loud."""
        return "x" * (2 * MAX_OBSERVATION)

    def get_reward(self) -> float:
        return float(len(self.basket))

    def _private(self) -> None:
        return None


def test_an_environments_tools_are_its_public_methods_with_their_schemas() -> None:
    shop = Shop()
    assert sorted(tools_of(shop)) == ["add", "calculator", "shout"]  # not reset, get_reward, _private
    add = next(s for s in tool_schemas(shop) if s["function"]["name"] == "add")["function"]
    assert add["parameters"]["required"] == ["item"]
    assert add["parameters"]["properties"]["count"] == {"type": "integer", "description": "How many."}

    class Vague:
        def look(self, where):  # type: ignore[no-untyped-def]  # no hints, no docstring
            return where

    with pytest.raises(ValueError, match="tool 'look' of Vague needs type hints and a docstring"):
        tool_schemas(Vague())


def test_calls_are_read_from_the_models_turn_and_a_malformed_one_says_why() -> None:
    turn = (
        'I will add two.<tool_call>{"name": "add", "arguments": {"item": "pear", "count": 2}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2+2\\"}"}</tool_call>'
        "<tool_call>{name: add}</tool_call>"
        '<tool_call>["add"]</tool_call>'
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{item"}</tool_call>'
    )
    calls = parse_tool_calls(turn)
    assert calls[:2] == [
        ToolCall("add", {"item": "pear", "count": 2}),
        ToolCall("calculator", {"expression": "2+2"}),
    ]
    assert [c.status for c in calls[2:]] == ["malformed"] * 4  # type: ignore[union-attr]
    assert "a string that is not JSON" in calls[5].text  # type: ignore[union-attr]
    assert "not JSON" in calls[2].text and "not an object" in calls[4].text  # type: ignore[union-attr]
    assert parse_tool_calls("no call here") == []


def test_every_failure_is_an_observation_never_an_exception() -> None:
    shop = Shop()
    shop.reset()
    said = {
        name: call_tool(shop, call)
        for name, call in {
            "ok": ToolCall("add", {"item": "pear", "count": 2}),
            "unknown": ToolCall("buy", {}),
            "missing": ToolCall("add", {}),
            "extra": ToolCall("add", {"item": "pear", "colour": "red"}),
            "type": ToolCall("add", {"item": "pear", "count": "two"}),
            "bool": ToolCall("add", {"item": "pear", "count": True}),
            "raises": ToolCall("add", {"item": "unicorn"}),
            "malformed": Observation("malformed", "not JSON"),
        }.items()
    }
    assert said["ok"] == Observation("ok", "2 in the basket") and shop.get_reward() == 2.0
    assert (
        said["unknown"].status == "unknown_tool" and "['add', 'calculator', 'shout']" in said["unknown"].text
    )
    assert [said[k].status for k in ("missing", "extra", "type", "bool")] == ["bad_arguments"] * 4
    assert said["type"].text == "add: argument 'count' must be int, got str"
    assert said["raises"] == Observation("tool_error", "add failed: LookupError: out of stock")
    assert said["malformed"].status == "malformed" and shop.get_reward() == 2.0  # nothing else was bought
    assert len(call_tool(shop, ToolCall("shout", {})).text) == MAX_OBSERVATION


def test_the_calculator_does_arithmetic_and_nothing_else() -> None:
    assert (
        calculate("(3 + 4) * 2") == 14
        and calculate("7 // 2 + 7 % 2 - -1") == 5
        and calculate("2 ** 10") == 1024
    )
    assert calculate("1 / 4") == 0.25
    for bad in (
        "__import__('os')",
        "x + 1",
        "(1).real",
        "[1, 2]",
        "'a' * 3",
        "9 ** 9 ** 9",
        "(10 ** 1000) ** 1000",
    ):
        with pytest.raises(ValueError):
            calculate(bad)
    shop = Shop()
    assert call_tool(shop, ToolCall("calculator", {"expression": "1 / 0"})).status == "tool_error"
    assert call_tool(shop, ToolCall("calculator", {"expression": "1e308 * 10"})).status == "tool_error"


def test_the_python_tool_answers_with_output_errors_and_limits() -> None:
    tool = PythonInterpreter(SandboxLimits(cpu_s=1, wall_s=5, output_bytes=100))
    assert call_tool(tool, ToolCall("python", {"code": "print(sum(range(10)))"})) == Observation("ok", "45\n")
    failed = call_tool(tool, ToolCall("python", {"code": "int('x')"}))
    assert failed.status == "tool_error" and "[stderr]" in failed.text and "ValueError" in failed.text
    spun = call_tool(tool, ToolCall("python", {"code": "while True:\n    pass"}))
    assert spun.status == "cpu_limit" and "[cpu_limit: stopped after" in spun.text
    loud = call_tool(tool, ToolCall("python", {"code": "print('z' * 1000)"}))
    assert loud.text.startswith("z" * 100) and "[output cut at 100 bytes a stream]" in loud.text
