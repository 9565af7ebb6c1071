"""Tools with JSON schemas, Hermes-style tool calls, and every bad call ending as an error outcome by kind."""

from __future__ import annotations

import asyncio
import time

import jsonschema
import pytest

from rlfabric.tools import (
    ERROR_KINDS,
    Tool,
    ToolCall,
    ToolReportedError,
    ToolSet,
    parse_hermes,
    tool_call_parser,
    tool_from_function,
)


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


async def lookup(key: str, default: str = "none") -> str:
    """Look a key up in the table."""
    return {"x": "42"}.get(key, default)


def broken(n: int) -> str:
    """Always fails."""
    raise ZeroDivisionError("division by zero")


def stuck(n: int) -> str:
    """Never answers in time."""
    time.sleep(2)
    return "late"


async def stuck_async(n: int) -> str:
    """Never answers in time either."""
    await asyncio.sleep(30)
    return "late"


def test_a_function_becomes_a_tool_with_a_schema_from_its_hints():
    tool = tool_from_function(lookup)
    assert tool.name == "lookup" and tool.description == "Look a key up in the table."
    assert tool.parameters == {
        "type": "object",
        "properties": {"key": {"type": "string"}, "default": {"type": "string"}},
        "required": ["key"],
        "additionalProperties": False,
    }
    assert tool.definition()["function"]["name"] == "lookup"

    def unhinted(x):
        return x

    with pytest.raises(TypeError, match="tool unhinted: parameter 'x' needs a type hint"):
        tool_from_function(unhinted)


def test_hermes_calls_are_parsed_in_order_and_a_malformed_one_is_named():
    text = (
        'I will compute. <tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>'
    )
    assert parse_hermes(text).calls == [ToolCall("multiply", {"a": 3, "b": 4}), ToolCall("lookup", {"key": "x"})]
    assert parse_hermes("the answer is 12").calls == []
    assert parse_hermes('<tool_call>{"name": "lookup", "arguments": {"key": "x"}}').calls == [
        ToolCall("lookup", {"key": "x"})
    ]  # cut at the token budget before the closing tag
    assert parse_hermes("<tool_call>{name: multiply}</tool_call>").malformed.startswith("not JSON")
    assert parse_hermes('<tool_call>{"arguments": {}}</tool_call>').malformed == 'a call needs a "name" string'
    assert parse_hermes('<tool_call>{"name": "f", "arguments": [1]}</tool_call>').malformed == (
        '"arguments" must be an object'
    )
    assert tool_call_parser("hermes") is parse_hermes
    with pytest.raises(ValueError, match="env.tool_parser = 'xml' is not valid: expected one of hermes"):
        tool_call_parser("xml", "env.tool_parser")


def run_calls(tools: ToolSet, calls: list[ToolCall], timeout_s: float = 0.3) -> list:
    async def main():
        return await asyncio.gather(*(tools.call(c, timeout_s) for c in calls))

    return asyncio.run(main())


def test_good_calls_answer_and_every_bad_one_is_an_error_of_its_kind_within_the_deadline():
    tools = ToolSet([multiply, lookup, broken, stuck, stuck_async])
    calls = [
        ToolCall("multiply", {"a": 6, "b": 7}),
        ToolCall("lookup", {"key": "x"}),
        ToolCall("divide", {"a": 1}),
        ToolCall("multiply", {"a": "6", "b": 7}),
        ToolCall("multiply", {"a": 6}),
        ToolCall("multiply", {"a": 6, "b": 7, "c": 1}),
        ToolCall("broken", {"n": 1}),
        ToolCall("stuck", {"n": 1}),
        ToolCall("stuck_async", {"n": 1}),
    ]
    started = time.monotonic()
    outcomes = run_calls(tools, calls)
    assert time.monotonic() - started < 1.5  # the hung tools hit their deadline together
    assert [o.error for o in outcomes] == [
        None,
        None,
        "unknown_tool",
        "invalid_arguments",
        "invalid_arguments",
        "invalid_arguments",
        "tool_error",
        "tool_timeout",
        "tool_timeout",
    ]
    assert {o.error for o in outcomes} - {None} <= set(ERROR_KINDS)
    assert [o.text for o in outcomes[:2]] == ["42", "42"]
    assert outcomes[2].text.startswith("error: unknown tool 'divide' (tools: broken, lookup, multiply")
    assert outcomes[3].text == "error: multiply a: '6' is not of type 'integer'"
    assert outcomes[4].text == "error: multiply arguments: 'b' is a required property"
    assert outcomes[6].text == "error: broken raised ZeroDivisionError: division by zero"
    assert outcomes[7].text == "error: stuck did not answer within 0.3s"


def test_a_tools_own_error_answer_reads_in_its_words():
    """An MCP server's error result (McpToolError) is a ToolReportedError: the agent sees what the tool said, not
    an exception class of rlfabric's."""

    def refusing(n: int) -> str:
        """Refuses odd numbers."""
        raise ToolReportedError(f"{n} is odd")

    [outcome] = run_calls(ToolSet([refusing]), [ToolCall("refusing", {"n": 3})])
    assert (outcome.text, outcome.error) == ("error: refusing: 3 is odd", "tool_error")


def test_a_tool_set_refuses_repeated_names_and_bad_schemas():
    with pytest.raises(ValueError, match="tool names repeat"):
        ToolSet([multiply, multiply])
    bad = Tool("bad", "a bad schema", {"type": "no-such-type"}, multiply)
    with pytest.raises(jsonschema.SchemaError, match="no-such-type"):
        ToolSet([bad])
