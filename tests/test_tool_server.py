"""Supervised MCP tool servers (``rlfabric.actors.tool_server``): a Ray actor starts a streamable HTTP server,
hands its URL to episodes, which hold a session each on it (32 at once, none seeing another's notes); a server
killed mid-episode fails exactly the episodes whose sessions it held, with the error, and is back for the next
ones; a hung server is restarted too; stop() leaves no process behind.

A stdio server (a command without ``{port}``) runs behind the stdio gateway, a child process per session: 8
episodes at once each keep their own notes, a child killed mid-episode fails only its own episode; the probe
session sees a command that dies and one that no longer starts; stop() ends every child; a command that does not
start is one error naming it and its stderr; ``env.tool_servers`` serves McpTasks episodes from a stdio command."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import ray
from test_mcp_tools import RecallTask, recall_player

from rlfabric.actors.llm_rollout import TextEnvSource
from rlfabric.actors.tool_server import ToolServer
from rlfabric.agent_loop import EpisodeLimits, ScriptedTurns, Turn, run_episodes
from rlfabric.data import load_prompts
from rlfabric.envs.mcp_tasks import McpTaskEnv, solution_player
from rlfabric.llm_text_env import start_tool_servers, stop_tool_servers
from rlfabric.mcp_server_process import http_command
from rlfabric.mcp_tools import McpSession, McpSessionLost
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import TOOL_ALPHABET, build_char_tokenizer
from rlfabric.tool_env import McpToolEnv

NOTES_HTTP = "python -m rlfabric.envs.notes_server --http {port}"
NOTES_STDIO = "python -m rlfabric.envs.notes_server"
CHAT = ChatTokens(build_char_tokenizer(TOOL_ALPHABET))
LIMITS = EpisodeLimits(max_turns=3, turn_tokens=96, max_episode_tokens=2048, step_timeout_s=30.0)

# A small stdio MCP server written on the bare protocol (one JSON-RPC message a line), so that tests which start
# many processes start them in milliseconds. Tools: pid (its process id), sleep(seconds) (answers after that long,
# meanwhile serving other calls). --die-after S: it exits with status 4 after S seconds; --once FILE: it starts
# only if FILE does not exist yet (and creates it), else exits with status 3 at once, saying so on stderr.
TINY_SERVER = r"""
import json, os, sys, threading
args = sys.argv[1:]
if "--once" in args:
    marker = args[args.index("--once") + 1]
    if os.path.exists(marker):
        print("this server starts only once", file=sys.stderr)
        sys.exit(3)
    open(marker, "w").close()
if "--die-after" in args:
    threading.Timer(float(args[args.index("--die-after") + 1]), os._exit, (4,)).start()
lock = threading.Lock()
def reply(request_id, result):
    with lock:
        print(json.dumps({"jsonrpc": "2.0", "id": request_id, "result": result}), flush=True)
seconds = {"type": "object", "properties": {"seconds": {"type": "number"}}}
tools = [{"name": "pid", "inputSchema": {"type": "object"}}, {"name": "sleep", "inputSchema": seconds}]
for line in sys.stdin:
    message = json.loads(line)
    if "id" not in message:
        continue
    method, params = message.get("method"), message.get("params") or {}
    if method == "initialize":
        info, version = {"name": "tiny", "version": "1"}, params["protocolVersion"]
        reply(message["id"], {"protocolVersion": version, "capabilities": {"tools": {}}, "serverInfo": info})
    elif method == "tools/list":
        reply(message["id"], {"tools": tools})
    elif method == "tools/call" and params["name"] == "sleep":
        seconds = params["arguments"]["seconds"]
        threading.Timer(seconds, reply, (message["id"], {"content": [{"type": "text", "text": "slept"}]})).start()
    elif method == "tools/call":
        reply(message["id"], {"content": [{"type": "text", "text": str(os.getpid())}]})
    else:
        reply(message["id"], {})
"""


def tiny_server(*flags: str) -> list[str]:
    return [sys.executable, "-c", TINY_SERVER, *flags]


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_for(predicate, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


class KillBeforeSecondCall(ScriptedTurns):
    """Recall turns; once every episode has asked for its second turn (all have stored their value), the server
    is killed, so each episode's second call meets a dead server."""

    def __init__(self, episodes: int, pid: int) -> None:
        super().__init__(recall_player, CHAT)
        self.waiting, self.episodes, self.pid = 0, episodes, pid
        self.all_stored = asyncio.Event()

    async def next_turn(self, context: list[int], messages: list[dict], task: dict) -> Turn:
        if len(messages) // 2 - 1 == 1:  # the second turn: get
            self.waiting += 1
            if self.waiting == self.episodes:
                os.kill(self.pid, signal.SIGKILL)
                self.all_stored.set()
            await self.all_stored.wait()
        return await super().next_turn(context, messages, task)


def play(server, turns, episodes: int) -> list:
    tasks = [{"key": "k", "value": f"v{i}"} for i in range(episodes)]
    return asyncio.run(run_episodes(lambda: McpToolEnv(RecallTask(), server), tasks, turns, CHAT, LIMITS))


def test_a_killed_server_fails_the_episodes_it_held_and_is_back_for_32_isolated_sessions(local_ray):
    server = ToolServer.remote("notes", NOTES_HTTP, health_interval_s=0.2)
    url = ray.get(server.start.remote())
    first = ray.get(server.health.remote())
    assert first["alive"] and first["generation"] == 0 and url.startswith("http://127.0.0.1:")

    played = play(server, KillBeforeSecondCall(4, first["pid"]), 4)
    assert [e.error is not None for e in played] == [True] * 4  # every session it held is lost ...
    assert all("closed" in e.error and url in e.error for e in played), played[0].error  # ... with the reason
    assert all(len(e.turns) == 1 for e in played)  # the put went through before the kill; nothing after

    health = wait_for(lambda: (h := ray.get(server.health.remote()))["alive"] and h["generation"] == 1 and h)
    assert health["restarts"] == 1 and "exited" in health["last_error"] and health["pid"] != first["pid"]
    assert not alive(first["pid"])

    again = play(server, ScriptedTurns(recall_player, CHAT), 32)  # 32 sessions at once on the new process
    for i, episode in enumerate(again):
        assert episode.error is None and episode.rewards == {"correct": 1.0}, episode.error
        assert episode.texts[-1] == f"v{i}"  # each read back its own value under the shared key

    ray.get(server.stop.remote())
    assert not alive(health["pid"])
    with pytest.raises(ray.exceptions.RayTaskError, match="was stopped"):
        ray.get(server.address.remote())


def test_a_hung_server_misses_its_ping_and_is_restarted(local_ray):
    stopped = ToolServer.remote("notes", NOTES_HTTP, health_interval_s=0.2, ping_timeout_s=0.5)
    ray.get(stopped.start.remote())
    pid = ray.get(stopped.health.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)  # alive but not answering
    try:
        health = wait_for(lambda: (h := ray.get(stopped.health.remote()))["generation"] == 1 and h["alive"] and h)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)
    assert "ping deadline" in health["last_error"]
    assert wait_for(lambda: not alive(pid), 10.0) is True  # the hung process was killed, not left behind
    assert play(stopped, ScriptedTurns(recall_player, CHAT), 2)[1].rewards == {"correct": 1.0}
    ray.get(stopped.stop.remote())


def test_a_server_that_does_not_start_is_one_clear_error_naming_its_command_and_output(local_ray):
    with pytest.raises(ValueError, match=r"has no \{port\}"):
        http_command("python -m rlfabric.envs.notes_server", 1234)
    exits = "import sys; print('unknown flag --port', file=sys.stderr); sys.exit(3)"
    broken = ToolServer.remote("broken", [sys.executable, "-c", exits, "{port}"], start_timeout_s=10.0)
    with pytest.raises(ray.exceptions.RayTaskError, match="'broken'.*did not start.*status 3.*unknown flag --port"):
        ray.get(broken.start.remote())
    # The same command over stdio (no {port}): its first session's child exits; the error names it and its stderr.
    stdio = ToolServer.remote("broken", [sys.executable, "-c", exits], start_timeout_s=10.0)
    with pytest.raises(
        ray.exceptions.RayTaskError,
        match=r"tool server 'broken' \(.*-c .*\) did not start: .*exited with status 3; stderr: unknown flag --port",
    ):
        ray.get(stdio.start.remote())
    gateway = ray.get(stdio.health.remote())["pid"]
    assert gateway is not None and wait_for(lambda: not alive(gateway), 10.0)  # nothing left behind
    ghost = ToolServer.remote("ghost", "no-such-mcp-server --stdio", start_timeout_s=10.0)
    with pytest.raises(
        ray.exceptions.RayTaskError, match="'ghost' .no-such-mcp-server --stdio. did not start.*No such file"
    ):
        ray.get(ghost.start.remote())


def test_a_server_listens_where_its_actor_is_told_and_on_loopback_on_one_node(local_ray):
    # On a cluster of several nodes the actor serves on its node's address; here an explicit one stands in for it.
    elsewhere = ToolServer.remote("notes", f"{NOTES_HTTP} --host {{host}}", host="127.0.0.2")
    assert ray.get(elsewhere.start.remote()).startswith("http://127.0.0.2:")
    assert [e.rewards for e in play(elsewhere, ScriptedTurns(recall_player, CHAT), 2)] == [{"correct": 1.0}] * 2
    ray.get(elsewhere.stop.remote())
    local = ToolServer.remote("notes", NOTES_HTTP)  # one node: loopback, reachable from nowhere else
    assert ray.get(local.address.remote())[0].startswith("http://127.0.0.1:")
    ray.get(local.stop.remote())


class KillOneChild(ScriptedTurns):
    """Recall turns; once every episode has stored its value (asks for its second turn), one episode's stdio child
    (a pid the gateway serves that is not the probe's) is killed, and all go on to read their value back."""

    def __init__(self, episodes: int, server, probe_pids: set[int]) -> None:
        super().__init__(recall_player, CHAT)
        self.waiting, self.episodes, self.server, self.probe_pids = 0, episodes, server, probe_pids
        self.all_stored = asyncio.Event()
        self.session_pids: list[int] = []
        self.killed = 0

    async def next_turn(self, context: list[int], messages: list[dict], task: dict) -> Turn:
        if len(messages) // 2 - 1 == 1:  # the second turn: get
            self.waiting += 1
            if self.waiting == self.episodes:
                health = await self.server.health.remote()
                self.session_pids = sorted(set(health["child_pids"]) - self.probe_pids)
                self.killed = self.session_pids[len(self.session_pids) // 2]
                os.kill(self.killed, signal.SIGKILL)
                self.all_stored.set()
            await self.all_stored.wait()
        return await super().next_turn(context, messages, task)


def test_stdio_server_gives_each_session_its_own_child_and_a_killed_child_fails_only_its_episode(local_ray):
    server = ToolServer.remote("notes", NOTES_STDIO, health_interval_s=0.5, probe_interval_s=600.0)
    url = ray.get(server.start.remote())
    first = ray.get(server.health.remote())
    assert url.startswith("http://127.0.0.1:") and first["mode"] == "stdio" and first["alive"]
    assert first["sessions"] == 1 and len(first["child_pids"]) == 1  # the probe session's child

    turns = KillOneChild(8, server, set(first["child_pids"]))
    played = play(server, turns, 8)
    assert len(turns.session_pids) == 8  # one child per session, all at once
    failed = [i for i, e in enumerate(played) if e.error is not None]
    assert len(failed) == 1, [e.error for e in played]  # only the killed child's episode ...
    error = played[failed[0]].error
    assert "killed by signal 9" in error and "rlfabric.envs.notes_server" in error, error  # ... with the reason
    assert len(played[failed[0]].turns) == 1  # its put went through, its get met the dead child
    for i, episode in enumerate(played):
        if i not in failed:  # the other 7 read back their own value under the shared key: no cross-talk
            assert episode.rewards == {"correct": 1.0} and episode.texts[-1] == f"v{i}", episode.error
    assert not alive(turns.killed)

    # The episodes' children ended with their sessions; the probe's goes on, and the gateway was never restarted.
    after = wait_for(lambda: (h := ray.get(server.health.remote()))["child_pids"] == first["child_pids"] and h)
    assert after["restarts"] == 0 and after["generation"] == 0 and after["alive"] and after["pid"] == first["pid"]
    assert after["sessions"] == 1
    assert not any(alive(pid) for pid in turns.session_pids)
    ray.get(server.stop.remote())
    assert wait_for(lambda: not alive(first["pid"]) and not alive(first["child_pids"][0]), 10.0)


async def until(check, timeout_s: float = 30.0):
    """``wait_for`` inside an event loop: polls the coroutine function ``check`` without blocking the loop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := await check():
            return value
        await asyncio.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_a_killed_gateway_takes_its_children_along_and_is_restarted_and_stop_or_kill_ends_every_process(local_ray):
    server = ToolServer.remote("tiny", tiny_server(), health_interval_s=0.2)
    url = ray.get(server.start.remote())

    async def sessions_across_a_gateway_death_and_stop() -> tuple[list[int], dict, dict]:
        sessions = [await McpSession.open(url) for _ in range(3)]
        with pytest.raises(TimeoutError):  # a call past its deadline is cancelled; the session goes on
            await asyncio.wait_for(sessions[0].call("sleep", {"seconds": 30}), 0.5)
        pids = [int(await s.call("pid")) for s in sessions]
        first = await server.health.remote()
        assert all(alive(pid) for pid in first["child_pids"])

        os.kill(first["pid"], signal.SIGKILL)  # the gateway dies: its children with it; the actor starts a new one
        await until(lambda: _restarted(server))
        with pytest.raises(McpSessionLost, match="has no session"):  # the old sessions are gone, and say so
            await sessions[0].call("pid")
        fresh = [await McpSession.open(url) for _ in range(2)]
        assert len({int(await s.call("pid")) for s in fresh}) == 2
        second = await server.health.remote()

        await server.stop.remote()
        with pytest.raises(McpSessionLost):
            await fresh[0].call("pid")
        for session in sessions + fresh:
            await session.close()
        return pids, first, second

    pids, first, second = asyncio.run(sessions_across_a_gateway_death_and_stop())
    assert len(set(pids)) == 3 and set(pids) < set(first["child_pids"]) and first["sessions"] == 4  # and the probe
    assert second["sessions"] == 3 and second["restarts"] == 1 and "exited" in second["last_error"]
    for pid in [first["pid"], *first["child_pids"], second["pid"], *second["child_pids"]]:
        assert wait_for(lambda pid=pid: not alive(pid), 10.0)

    doomed = ToolServer.remote("tiny", tiny_server())  # an actor that dies takes its gateway and children along
    ray.get(doomed.start.remote())
    held = ray.get(doomed.health.remote())
    ray.kill(doomed, no_restart=True)
    for pid in [held["pid"], *held["child_pids"]]:
        assert wait_for(lambda pid=pid: not alive(pid), 10.0)


async def _restarted(server) -> bool:
    health = await server.health.remote()
    return health["generation"] == 1 and health["alive"]


def test_the_probe_sees_a_command_that_dies_and_then_one_that_no_longer_starts(local_ray, tmp_path):
    dies = ToolServer.remote("dies", tiny_server("--die-after", "0.5"), health_interval_s=0.2)
    ray.get(dies.start.remote())
    health = wait_for(lambda: (h := ray.get(dies.health.remote()))["probe_failures"] >= 2 and h)
    assert "probe session's server failed its ping" in health["last_error"]
    assert "exited with status 4" in health["last_error"], health["last_error"]
    assert health["restarts"] == 0  # a dying child is not the gateway's fault: it is not restarted
    ray.get(dies.stop.remote())

    marker = tmp_path / "started"
    once = ToolServer.remote("once", tiny_server("--die-after", "0.5", "--once", str(marker)), health_interval_s=0.2)
    ray.get(once.start.remote())  # the first child starts, then dies: every new one exits at once
    health = wait_for(lambda: (h := ray.get(once.health.remote()))["probe_failures"] >= 1 and not h["alive"] and h)
    assert "did not start" in health["last_error"] and "starts only once" in health["last_error"], health
    assert "exited with status 3" in health["last_error"] and health["restarts"] == 0 and health["sessions"] == 0
    ray.get(once.stop.remote())


def test_env_tool_servers_runs_a_stdio_command_for_mcp_tasks_episodes(local_ray):
    source = TextEnvSource("rlfabric/McpTasks-v0", {"servers": ["notes"]}, LIMITS, b"", "")
    handles = start_tool_servers({"notes": NOTES_STDIO}, source, None)
    try:
        assert source.kwargs["tool_servers"] == handles
        health = ray.get(handles["notes"].health.remote())
        assert health["mode"] == "stdio" and health["alive"]
        tasks = load_prompts("task:mcp?servers=notes&min_calls=1&max_calls=2", num_rows=2, seed=5)
        limits = EpisodeLimits(max_turns=6, turn_tokens=512, max_episode_tokens=16384, step_timeout_s=30.0)
        episodes = asyncio.run(
            run_episodes(lambda: McpTaskEnv(**source.kwargs), tasks, ScriptedTurns(solution_player, CHAT), CHAT, limits)
        )
        assert [e.rewards.get("correct") for e in episodes] == [1.0, 1.0], [e.error for e in episodes]
        assert sum(e.rewards["calls"] for e in episodes) == sum(t["calls"] for t in tasks)
    finally:
        stop_tool_servers(handles)
    assert not alive(health["pid"]) and not any(alive(pid) for pid in health["child_pids"])
