"""Tools as Python functions with a JSON schema, tool calls parsed from model text by named parsers, and calls
checked and run under a deadline: every failure is a ``ToolOutcome`` with an error kind, never an exception.

A tool: ``Tool(name, description, parameters, function)``, ``parameters`` a JSON schema of the arguments object
(``tool_from_function`` builds it from a function's type hints). ``ToolSet.definitions()`` is what a chat template
takes as ``tools=``. The default call format is Hermes/Qwen's ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``; ``TOOL_CALL_PARSERS`` maps parser names to functions ``text -> ParsedCalls``, and more register by
name. Error kinds, counted as ``invalid_tool_calls`` by kind: ``malformed`` (unparseable call), ``unknown_tool``,
``invalid_arguments`` (schema violated), ``tool_error`` (the function raised), ``tool_timeout``. The one exception
a call lets through is ``EnvFailure``: the env itself broke (a tool server lost), which ends the episode as failed.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, get_type_hints

import jsonschema

from rlfabric.text_env import call_env

ERROR_KINDS = ("malformed", "unknown_tool", "invalid_arguments", "tool_error", "tool_timeout")
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


class EnvFailure(RuntimeError):
    """A tool failed because the environment broke (its server died or was restarted), not because of the call:
    ``ToolSet.call`` re-raises it, so the episode ends as failed (recorded, never trained on) instead of showing
    the agent an error it did not cause."""


class ToolReportedError(RuntimeError):
    """A tool's own error answer (an MCP server's error result): the agent sees ``error: <tool>: <message>``, the
    tool's words, where another exception reads ``error: <tool> raised <class>: <message>``."""


@dataclass(frozen=True)
class Tool:
    """A callable the agent may use: its name, what it does, the JSON schema of its arguments, the function."""

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any]

    def definition(self) -> dict[str, Any]:
        """The OpenAI-style function definition chat templates render."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def tool_from_function(function: Callable[..., Any], description: str | None = None) -> Tool:
    """A ``Tool`` for ``function``: its name, its docstring's first line (or ``description``), and a schema of its
    parameters from their type hints (str, int, float, bool, list, dict); parameters without a default are
    required, and no others are allowed."""
    hints = get_type_hints(function)
    properties, required = {}, []
    for name, param in inspect.signature(function).parameters.items():
        kind = _JSON_TYPES.get(hints.get(name))  # type: ignore[arg-type]
        if kind is None:
            raise TypeError(
                f"tool {function.__name__}: parameter {name!r} needs a type hint among "
                f"{', '.join(t.__name__ for t in _JSON_TYPES)}, or pass a Tool with its JSON schema"
            )
        properties[name] = {"type": kind}
        if param.default is inspect.Parameter.empty:
            required.append(name)
    doc = description or (inspect.getdoc(function) or "").split("\n")[0]
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return Tool(function.__name__, doc, schema, function)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedCalls:
    """What a parser found in a turn's text: well-formed calls, and the first malformed one's problem."""

    calls: list[ToolCall] = field(default_factory=list)
    malformed: str | None = None


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedCalls:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, in order (an unclosed last block
    counts: a turn cut at its token budget)."""
    out = ParsedCalls()
    for body in _HERMES_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            out.malformed = out.malformed or f"not JSON ({exc.msg} at character {exc.pos})"
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            out.malformed = out.malformed or 'a call needs a "name" string'
            continue
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            out.malformed = out.malformed or '"arguments" must be an object'
            continue
        out.calls.append(ToolCall(call["name"], arguments))
    return out


TOOL_CALL_PARSERS: dict[str, Callable[[str], ParsedCalls]] = {"hermes": parse_hermes}


def tool_call_parser(name: str, field_name: str = "tool_parser") -> Callable[[str], ParsedCalls]:
    """The parser registered as ``name``, or ValueError naming ``field_name`` and the registered names."""
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"{field_name} = {name!r} is not valid: expected one of {', '.join(sorted(TOOL_CALL_PARSERS))}"
        )
    return TOOL_CALL_PARSERS[name]


@dataclass
class ToolOutcome:
    """A call's result text, or its error kind (``ERROR_KINDS``) and a message the agent is shown."""

    text: str
    error: str | None = None


@functools.lru_cache(maxsize=1024)
def compiled_validator(schema_json: str) -> Any:
    """The checked, compiled validator of a tool's parameter schema (JSON text), built once per distinct schema.

    Every episode of an MCP or OpenEnv env builds its ToolSet from the tools its server lists, and checking a
    schema against the metaschema takes about 1 ms: a seventh of the driver's time when it plays the MCP example's
    warm-up demonstrations. Validators keep no state between calls, so one serves every ToolSet. An invalid schema
    raises (and is not cached)."""
    schema = json.loads(schema_json)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)


class ToolSet:
    """Tools by name; ``call`` checks a call against the schema and runs it under a deadline."""

    def __init__(self, tools: list[Tool | Callable[..., Any]]) -> None:
        built = [t if isinstance(t, Tool) else tool_from_function(t) for t in tools]
        self.tools = {t.name: t for t in built}
        if len(self.tools) != len(built):
            raise ValueError(f"tool names repeat: {[t.name for t in built]}")
        self.validators = {t.name: compiled_validator(json.dumps(t.parameters)) for t in built}

    def definitions(self) -> list[dict[str, Any]]:
        return [t.definition() for t in self.tools.values()]

    async def call(self, call: ToolCall, timeout_s: float) -> ToolOutcome:
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools))
            return ToolOutcome(f"error: unknown tool {call.name!r} (tools: {known})", "unknown_tool")
        error = jsonschema.exceptions.best_match(self.validators[call.name].iter_errors(call.arguments))
        if error is not None:  # the error jsonschema.validate would raise
            where = "/".join(map(str, error.absolute_path)) or "arguments"
            return ToolOutcome(f"error: {call.name} {where}: {error.message}", "invalid_arguments")
        try:  # a plain function runs in the env threads: one that hangs keeps its thread, not the loop
            result = await asyncio.wait_for(call_env(functools.partial(tool.function, **call.arguments)), timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            return ToolOutcome(f"error: {call.name} did not answer within {timeout_s:g}s", "tool_timeout")
        except EnvFailure:
            raise
        except ToolReportedError as exc:
            return ToolOutcome(f"error: {call.name}: {exc}", "tool_error")
        except Exception as exc:  # noqa: BLE001 - the tool's failure is the agent's observation
            return ToolOutcome(f"error: {call.name} raised {type(exc).__name__}: {exc}", "tool_error")
        return ToolOutcome(result if isinstance(result, str) else json.dumps(result))
