"""Supervised MCP tool servers (``rlfabric.actors.tool_server``): a Ray actor starts a streamable HTTP server,
hands its URL to episodes, which hold a session each on it (32 at once, none seeing another's notes); a server
killed mid-episode fails exactly the episodes whose sessions it held, with the error, and is back for the next
ones; a hung server is restarted too; stop() leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest
import ray
from test_mcp_tools import RecallTask, recall_player

from rlfabric.actors.tool_server import ToolServer
from rlfabric.agent_loop import EpisodeLimits, ScriptedTurns, Turn, run_episodes
from rlfabric.mcp_server_process import http_command
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import TOOL_ALPHABET, build_char_tokenizer
from rlfabric.tool_env import McpToolEnv

NOTES_HTTP = "python -m rlfabric.envs.notes_server --http {port}"
CHAT = ChatTokens(build_char_tokenizer(TOOL_ALPHABET))
LIMITS = EpisodeLimits(max_turns=3, turn_tokens=96, max_episode_tokens=2048, step_timeout_s=30.0)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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


def test_a_server_command_without_a_port_or_that_does_not_start_is_one_clear_error(local_ray):
    with pytest.raises(ValueError, match=r"has no \{port\}"):
        http_command("python -m rlfabric.envs.notes_server", 1234)
    exits = "import sys; print('unknown flag --port', file=sys.stderr); sys.exit(3)"
    broken = ToolServer.remote("broken", [sys.executable, "-c", exits, "{port}"], start_timeout_s=10.0)
    with pytest.raises(ray.exceptions.RayTaskError, match="'broken'.*did not start.*status 3.*unknown flag --port"):
        ray.get(broken.start.remote())


def test_a_server_listens_where_its_actor_is_told_and_on_loopback_on_one_node(local_ray):
    # On a cluster of several nodes the actor serves on its node's address; here an explicit one stands in for it.
    elsewhere = ToolServer.remote("notes", f"{NOTES_HTTP} --host {{host}}", host="127.0.0.2")
    assert ray.get(elsewhere.start.remote()).startswith("http://127.0.0.2:")
    assert [e.rewards for e in play(elsewhere, ScriptedTurns(recall_player, CHAT), 2)] == [{"correct": 1.0}] * 2
    ray.get(elsewhere.stop.remote())
    local = ToolServer.remote("notes", NOTES_HTTP)  # one node: loopback, reachable from nowhere else
    assert ray.get(local.address.remote())[0].startswith("http://127.0.0.1:")
    ray.get(local.stop.remote())
