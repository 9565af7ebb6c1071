"""An MCP server rlfabric did not write, plugged in by its command line alone: the reference time server
(``mcp-server-time`` from PyPI, pinned in the ``test`` extra). Its tools are listed by ``rlfabric tools list``,
called in real episodes through ``McpToolEnv`` (a server process per episode over stdio), and a call that breaks
their schemas is refused as ``invalid_arguments`` before anything is sent.

The server converts a wall-clock time on today's date, so the expected results use zones without daylight saving
time: UTC 14:30 is 20:00 in Kolkata (+5:30), 20:15 in Kathmandu (+5:45) and 07:30 in Phoenix (-7:00) on any day.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from rlfabric.agent_loop import EpisodeLimits, ScriptedTurns, run_episodes
from rlfabric.mcp_tools import McpSession, McpToolError
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import TOOL_ALPHABET, build_char_tokenizer
from rlfabric.text_env import TextStep
from rlfabric.tool_env import McpToolEnv
from rlfabric.tools import ToolCall, ToolSet

# The same server as the console script `mcp-server-time --local-timezone UTC`; `python -m` runs it under this
# interpreter whatever PATH holds.
TIME_SERVER = "python -m mcp_server_time --local-timezone UTC"
CONVERSIONS = [  # (target zone, UTC 14:30 there, its offset), worked out by hand
    ("Asia/Kolkata", "20:00", "+05:30"),
    ("Asia/Kathmandu", "20:15", "+05:45"),
    ("America/Phoenix", "07:30", "-07:00"),
]


class ClockTask:
    """Ask what UTC 14:30 is in the task's zone; the answer must be the HH:MM the task expects."""

    def reset(self, task: dict) -> str:
        self.expected = task["expected"]
        return f"It is 14:30 in UTC. What time is it in {task['zone']}? Answer HH:MM."

    def answer(self, text: str) -> TextStep:
        return TextStep("", {"correct": float(text == self.expected)}, terminated=True)


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def last_response(messages: list[dict]) -> str:
    return re.search(r"<tool_response>\n(.*)\n</tool_response>", messages[-1]["content"], re.DOTALL).group(1)


def clock_player(task: dict, messages: list[dict]) -> str:
    """Turn 0: a call that breaks the schema (the time as a number); turn 1: the right call; turn 2: the HH:MM
    of the converted time, read from the server's JSON reply."""
    turn = len(messages) // 2 - 1  # system + question, then assistant/user pairs
    if turn == 0:
        return call("convert_time", source_timezone="UTC", time=1430, target_timezone=task["zone"])
    if turn == 1:
        return call("convert_time", source_timezone="UTC", time="14:30", target_timezone=task["zone"])
    converted = json.loads(last_response(messages))["target"]["datetime"]  # e.g. 2026-01-31T20:00:00+05:30
    return converted[11:16]


def test_tools_list_shows_the_outside_servers_tools(capsys):
    from rlfabric.cli import main

    assert main(["tools", "list", TIME_SERVER]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"2 tools from MCP server {TIME_SERVER!r} (? marks an optional argument):",
        "  get_current_time(timezone: string)  Get current time in a specific timezone",
        "  convert_time(source_timezone: string, time: string, target_timezone: string)"
        "  Convert time between timezones",
    ]


def test_episodes_call_the_outside_server_and_answer_from_its_result():
    tasks = [{"zone": zone, "expected": hhmm} for zone, hhmm, _ in CONVERSIONS]
    chat = ChatTokens(build_char_tokenizer(TOOL_ALPHABET))
    limits = EpisodeLimits(max_turns=4, turn_tokens=160, max_episode_tokens=4096, step_timeout_s=60.0)
    player = ScriptedTurns(clock_player, chat)
    played = asyncio.run(run_episodes(lambda: McpToolEnv(ClockTask(), TIME_SERVER), tasks, player, chat, limits))
    for (zone, hhmm, offset), episode in zip(CONVERSIONS, played, strict=True):
        assert episode.error is None and episode.rewards == {"correct": 1.0}, episode.error
        assert episode.texts[-1] == hhmm
        assert episode.tool_calls == 2 and episode.invalid_tool_calls == {"invalid_arguments": 1}
        refused, converted = (chat.tokenizer.decode(turn.observation) for turn in episode.turns[:2])
        assert "error: convert_time time: 1430 is not of type 'string'" in refused
        assert f'"timezone": "{zone}"' in converted and f'T{hhmm}:00{offset}"' in converted
        assert '"source": {\n    "timezone": "UTC"' in converted
    system = chat.tokenizer.decode(played[0].prompt)
    assert "convert_time(source_timezone, time, target_timezone)" in system  # the listed tools, shown to the agent


@pytest.mark.parametrize(
    ("arguments", "refusal"),
    [
        (dict(source_timezone="UTC", time=1430, target_timezone="Asia/Tokyo"), "time: 1430 is not of type 'string'"),
        (dict(source_timezone="UTC", time="14:30"), "arguments: 'target_timezone' is a required property"),
    ],
    ids=["wrong-type", "missing"],
)
def test_a_schema_violating_call_is_refused_before_it_reaches_the_server(arguments, refusal):
    """The checked path refuses the call with the schema's words; the same call sent raw reaches the server, which
    answers in its own words (pydantic's): so the refusal was rlfabric's and nothing was sent."""

    async def both() -> tuple:
        session = await McpSession.open(TIME_SERVER)
        try:
            checked = await ToolSet(session.tools()).call(ToolCall("convert_time", arguments), 10.0)
            with pytest.raises(McpToolError) as raw:
                await session.call("convert_time", arguments)
            return checked, str(raw.value)
        finally:
            await session.close()

    checked, raw = asyncio.run(both())
    assert checked.error == "invalid_arguments" and checked.text == f"error: convert_time {refusal}"
    assert raw.startswith("Error executing tool convert_time: 1 validation error for convert_timeArguments")
    assert "validation error" not in checked.text
