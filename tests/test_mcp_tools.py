"""Tools from MCP servers through the official SDK, over stdio (a server process per episode) and streamable HTTP
(many sessions on one process): one session per episode, state isolated between concurrent episodes, every bad
or failing call an error observation, a server that does not start one error naming its command and its
stderr."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from pathlib import Path

import pytest
from http_servers import free_port, module_over_http
from processes import own_processes

from rlfabric.agent_loop import EpisodeLimits, ScriptedTurns, run_episodes
from rlfabric.mcp_tools import McpSession, McpSessionLost, McpStartError
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import TOOL_ALPHABET, build_char_tokenizer
from rlfabric.text_env import TextStep
from rlfabric.tool_env import McpToolEnv
from rlfabric.tools import ToolCall, ToolSet

NOTES_SERVER = "python -m rlfabric.envs.notes_server"
TEST_SERVER = [sys.executable, str(Path(__file__).parent / "mcp_test_server.py")]


class RecallTask:
    """Store the task's value under its key through the server, read it back, answer it."""

    def reset(self, task: dict) -> str:
        self.value = task["value"]
        return f"put {task['value']} under {task['key']}, get it, answer it"

    def answer(self, text: str) -> TextStep:
        return TextStep("", {"correct": float(text == self.value)}, terminated=True)


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def recall_player(task: dict, messages: list[dict]) -> str:
    turn = len(messages) // 2 - 1  # system + question, then assistant/user pairs
    if turn == 0:
        return call("put", key=task["key"], value=task["value"])
    if turn == 1:
        return call("get", key=task["key"])
    return re.search(r"<tool_response>\n(.*)\n</tool_response>", messages[-1]["content"]).group(1)


def notes_servers_running() -> int:
    return len(own_processes("rlfabric.envs.notes_server"))


def play_recall(server: str, episodes: int) -> tuple[list, ChatTokens]:
    """``episodes`` concurrent recall episodes on ``server``, all writing different values under one key; each
    must read back its own."""
    tasks = [{"key": "k", "value": f"v{i}"} for i in range(episodes)]
    chat = ChatTokens(build_char_tokenizer(TOOL_ALPHABET))
    limits = EpisodeLimits(max_turns=3, turn_tokens=96, max_episode_tokens=2048, step_timeout_s=60.0)
    played = asyncio.run(
        run_episodes(lambda: McpToolEnv(RecallTask(), server), tasks, ScriptedTurns(recall_player, chat), chat, limits)
    )
    for task, episode in zip(tasks, played, strict=True):
        assert episode.error is None and episode.rewards == {"correct": 1.0}, episode.error
        assert episode.texts[-1] == task["value"] and episode.tool_calls == 2 and episode.invalid_tool_calls == {}
    return played, chat


def test_concurrent_episodes_each_own_a_server_session_and_close_it():
    episodes, chat = play_recall(NOTES_SERVER, 6)
    system = chat.tokenizer.decode(episodes[0].prompt)
    assert "put(key, value)" in system and "keys()" in system  # the server's listed tools, shown to the agent
    assert notes_servers_running() == 0


@pytest.fixture
def notes_over_http():
    """The notes server serving streamable HTTP in its own process; its URL."""
    with module_over_http("rlfabric.envs.notes_server") as url:
        yield url


def test_sixteen_episodes_share_one_http_server_process_each_in_its_own_session(notes_over_http):
    play_recall(notes_over_http, 16)


def test_an_unreachable_url_is_one_error_naming_it():
    url = f"http://127.0.0.1:{free_port()}/mcp"  # nothing listens there
    with pytest.raises(McpStartError) as info:
        asyncio.run(McpSession.open(url, timeout_s=20.0))
    assert str(info.value).startswith(f"MCP server {url!r} could not be reached") and "\n" not in str(info.value)


def test_bad_and_failing_calls_become_error_observations_and_a_hang_meets_its_deadline():
    async def scenario() -> list:
        session = await McpSession.open(TEST_SERVER)
        tools = ToolSet(session.tools())
        try:
            outcomes = [
                await tools.call(ToolCall("echo", {"text": "hi"}), 5.0),
                await tools.call(ToolCall("nope", {}), 5.0),
                await tools.call(ToolCall("wait", {"seconds": "long"}), 5.0),
                await tools.call(ToolCall("crash", {}), 5.0),
            ]
            start = time.monotonic()
            outcomes.append(await tools.call(ToolCall("wait", {"seconds": 60}), 0.5))
            outcomes.append(time.monotonic() - start)
            outcomes.append(await tools.call(ToolCall("echo", {"text": "still here"}), 5.0))
            for last in ("die", "echo"):  # the server dies during the call, then is gone
                try:
                    await tools.call(ToolCall(last, {"text": "gone"} if last == "echo" else {}), 5.0)
                    outcomes.append(None)
                except McpSessionLost as exc:
                    outcomes.append(str(exc))
        finally:
            await session.close()
        return outcomes

    ok, unknown, invalid, crashed, hung, hung_s, after, died, gone = asyncio.run(scenario())
    assert (ok.text, ok.error) == ("hi", None)
    assert unknown.error == "unknown_tool" and "crash, die, echo, wait" in unknown.text
    assert invalid.error == "invalid_arguments" and "seconds" in invalid.text
    assert crashed.error == "tool_error" and "Error executing tool crash" in crashed.text  # the server's own words
    assert hung.error == "tool_timeout" and hung_s < 5.0
    assert (after.text, after.error) == ("still here", None)  # the cancelled call left the session usable
    # A dead server fails the episode (an EnvFailure, not an observation of the agent's doing), never hangs it.
    assert died is not None and "mcp_test_server.py" in died and "closed" in died
    assert gone is not None and "closed" in gone


@pytest.mark.parametrize(
    ("command", "says"),
    [
        ("no-such-mcp-server --flag", "FileNotFoundError"),
        ([sys.executable, "-c", "import sys; print('bad config line 3', file=sys.stderr); sys.exit(2)"], "line 3"),
    ],
    ids=["missing", "exits"],
)
def test_a_server_that_does_not_start_is_one_error_naming_its_command_and_stderr(command, says):
    with pytest.raises(McpStartError) as info:
        asyncio.run(McpSession.open(command, timeout_s=30.0))
    message = str(info.value)
    assert message.startswith("MCP server ") and says in message and "\n" not in message
    assert (command if isinstance(command, str) else "-c").split()[0] in message


def test_a_server_that_never_answers_the_handshake_misses_its_start_deadline():
    silent = [sys.executable, "-c", "import time; time.sleep(60)"]
    start = time.monotonic()
    with pytest.raises(McpStartError, match="within 1s"):
        asyncio.run(McpSession.open(silent, timeout_s=1.0))
    assert time.monotonic() - start < 8.0  # the handshake is abandoned, the process stopped


def test_tools_list_shows_a_servers_tools_and_a_bad_command_is_one_line(capsys):
    from rlfabric.cli import main

    assert main(["tools", "list", NOTES_SERVER]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 tools from MCP server")
    assert "put(key: string, value: string)  Store value under key" in out and "keys()" in out
    assert main(["tools", "list", "no-such-mcp-server --flag"]) == 1  # a command line that does not run
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlfabric: tools list: MCP server 'no-such-mcp-server --flag'") and "\n" not in err
    assert main(["tools", "list", "notez"]) == 1  # one word: a task server's name, misspelt
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlfabric: tools list: 'notez' is not a task server (did you mean 'notes'?) nor a command")
    assert "\n" not in err
