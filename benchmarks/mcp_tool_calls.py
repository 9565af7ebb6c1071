"""MCP tool calls: rlfabric's tool path against a bare ``mcp`` SDK client, and tools on an MCP server against the
same tools as Python functions, one run.

Part 1, tool round trips. One streamable-HTTP notes server process (``python -m rlfabric.envs.notes_server --http
PORT``, started here) serves ``S`` sessions (1 and 64) opened before the clock starts, all driven from one asyncio
loop (the way a rollout worker runs its episodes). Each session calls in a loop for ``--duration`` seconds; a
round trip is ``put(key, value)`` then ``get(key)`` (checked to return the value). Contenders, alternating:

1. ``bare mcp client`` (the anchor): ``streamable_http_client`` + ``ClientSession.call_tool``, nothing else;
2. ``rlfabric tool path``: a session from ``McpSession.open(url)``, calls through
   ``ToolSet(session.tools()).call(ToolCall(...), timeout_s)``: the schema check, the deadline and the result
   mapping the env does on every call.

Reported: calls/s of each (two calls a round trip), the median of ``--repeats`` (5) rounds of ``--duration``
(2) s after a 1 s warm-up, the order flipping each round, and the ratio rlfabric / bare of the medians (the
target is >= 0.9), with the range of the rounds' own ratios; and the client process's CPU time per call (the
server's excluded), which moves less with other load on the machine than calls/s does.

Part 2, agent episodes. ``--episodes`` (64) concurrent scripted episodes through ``run_episodes`` (the character
tokenizer's chat tokens, as in the tests): the player makes ``k`` tool calls (``put`` then ``get``s of one key, one
call a turn) and then answers the value; every episode is checked to end correct with ``k`` calls and none
invalid. Contenders, alternating, the median of ``--episode-repeats`` (3) rounds after a warm-up:

1. ``Python functions`` (the anchor): a ``ToolEnv`` whose tools are ``put``/``get`` on a dict of its own;
2. ``MCP over HTTP``: a ``McpToolEnv`` on the notes server process above, a session per episode (opened at reset
   and closed when the episode ends, both timed: the protocol's cost);
3. ``MCP over stdio``: a ``McpToolEnv`` starting a notes server process per episode. Starting one (Python and
   the SDK's imports) costs about 1.7 s of CPU here, so this contender plays ``--stdio-episodes`` (16) episodes,
   ``--stdio-repeats`` (1) times, no warm-up; its row says so.

Usage::

    python benchmarks/mcp_tool_calls.py [--sessions 1 64] [--duration 2] [--repeats 5] [--calls 1 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import date
from pathlib import Path
from typing import Any

import mcp

from rlfabric.agent_loop import EpisodeLimits, ScriptedTurns, run_episodes
from rlfabric.mcp_server_process import free_port
from rlfabric.mcp_tools import McpSession
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import TOOL_ALPHABET, build_char_tokenizer
from rlfabric.text_env import TextStep
from rlfabric.tool_env import McpToolEnv, ToolEnv
from rlfabric.tools import ToolCall, ToolSet

HERE = Path(__file__).resolve().parent
BARE, RLFABRIC = "bare mcp client", "rlfabric tool path"
PYTHON, HTTP, STDIO = "Python functions", "MCP over HTTP", "MCP over stdio"
NOTES_STDIO = "python -m rlfabric.envs.notes_server"
CALL_TIMEOUT_S = 30.0

# -- the server ---------------------------------------------------------------------------------------------------


def start_notes_server(timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """The notes server serving streamable HTTP in its own process, and its URL once it accepts connections."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "rlfabric.envs.notes_server", "--http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return process, f"http://127.0.0.1:{port}/mcp"
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the notes server did not listen on port {port} within {timeout_s:g}s")


# -- part 1: tool round trips -----------------------------------------------------------------------------------

# A round trip on one session: (session index, round number) -> None, raising if the value does not come back.
RoundTrip = Callable[[int, int], Awaitable[None]]


async def bare_session(url: str, opened: Callable[[RoundTrip], Awaitable[None]]) -> None:
    """Hold a bare SDK session (its transport's task groups must be entered and left by this task) while
    ``opened`` drives round trips on it."""
    from mcp.client.streamable_http import streamable_http_client

    async with streamable_http_client(url) as (read, write):
        async with mcp.ClientSession(read, write) as session:
            await session.initialize()
            # The SDK lists a server's tools before the first call of one (to check results against their output
            # schemas); listed here, before the clock, as McpSession.open does, so both sides time calls only.
            await session.list_tools()

            async def round_trip(i: int, n: int) -> None:
                await session.call_tool("put", {"key": f"k{i}", "value": f"v{n}"})
                got = await session.call_tool("get", {"key": f"k{i}"})
                if got.is_error or got.content[0].text != f"v{n}":
                    raise AssertionError(f"session {i} read back {got.content!r}, not v{n}")

            await opened(round_trip)


async def rlfabric_session(url: str, opened: Callable[[RoundTrip], Awaitable[None]]) -> None:
    """A session from ``McpSession.open``, called through a ``ToolSet`` as the tool env does."""
    session = await McpSession.open(url)
    tools = ToolSet(session.tools())
    try:

        async def round_trip(i: int, n: int) -> None:
            await tools.call(ToolCall("put", {"key": f"k{i}", "value": f"v{n}"}), CALL_TIMEOUT_S)
            got = await tools.call(ToolCall("get", {"key": f"k{i}"}), CALL_TIMEOUT_S)
            if got.error is not None or got.text != f"v{n}":
                raise AssertionError(f"session {i} read back {got.text!r}, not v{n}")

        await opened(round_trip)
    finally:
        await session.close()


async def round_trips(hold: Callable, url: str, sessions: int, duration_s: float) -> dict[str, float]:
    """``sessions`` sessions opened first, then all calling in a loop for ``duration_s``; calls/s over the time
    from the start signal to the last session's last completed round trip (opening and closing untimed)."""
    ready = asyncio.Semaphore(0)
    go = asyncio.Event()
    start, cpu = [0.0], [0.0, 0.0]
    ends: list[float] = []
    counts: list[int] = []

    async def one(i: int) -> None:
        async def opened(round_trip: RoundTrip) -> None:
            ready.release()
            await go.wait()
            n = 0
            while time.perf_counter() < start[0] + duration_s:
                await round_trip(i, n)
                n += 1
            ends.append(time.perf_counter())
            counts.append(n)
            if len(ends) == sessions:  # the last session done: the calls' CPU, before any session closes
                cpu[1] = time.process_time()

        await hold(url, opened)

    workers = [asyncio.create_task(one(i)) for i in range(sessions)]
    for _ in range(sessions):
        await ready.acquire()
    start[0], cpu[0] = time.perf_counter(), time.process_time()
    go.set()
    await asyncio.gather(*workers)
    elapsed = max(ends) - start[0]
    calls = 2 * sum(counts)
    # This process's CPU (the server's is its own) per call: less at the mercy of other load than calls/s.
    client_ms = 1e3 * (cpu[1] - cpu[0]) / calls
    return {"calls": calls, "seconds": elapsed, "calls_per_s": calls / elapsed, "client_cpu_ms_per_call": client_ms}


def measure_round_trips(url: str, sessions: int, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up, then ``args.repeats`` alternating rounds of both contenders; medians and the ratio."""
    holds = {BARE: bare_session, RLFABRIC: rlfabric_session}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in holds}
    for round_ in range(args.repeats + 1):  # round 0 warms up
        order = list(holds) if round_ % 2 else list(holds)[::-1]  # neither always goes first
        for name in order:
            duration = args.duration if round_ else min(1.0, args.duration)
            result = asyncio.run(round_trips(holds[name], url, sessions, duration))
            if round_:
                runs[name].append(result)
    row: dict[str, Any] = {"sessions": sessions}
    for name, results in runs.items():
        rates = [r["calls_per_s"] for r in results]
        cpu = statistics.median(r["client_cpu_ms_per_call"] for r in results)
        row[name] = {"calls_per_s": statistics.median(rates), "client_cpu_ms_per_call": cpu, "runs": results}
    row["ratio"] = row[RLFABRIC]["calls_per_s"] / row[BARE]["calls_per_s"]
    # Each round's own ratio too: on a shared machine the load drifts between rounds more than within one.
    pairs = zip(runs[RLFABRIC], runs[BARE], strict=True)
    row["round_ratios"] = [mine["calls_per_s"] / bare["calls_per_s"] for mine, bare in pairs]
    return row


# -- part 2: agent episodes -------------------------------------------------------------------------------------


class RecallTask:
    """Keep the task's value under its key with the tools, answer it; correct if the answer is the value."""

    def reset(self, task: dict[str, Any]) -> str:
        self.value = task["value"]
        return f"put {task['value']} under {task['key']}, get it, answer it"

    def answer(self, text: str) -> TextStep:
        return TextStep("", {"correct": float(text == self.value)}, terminated=True)


def store_tools() -> ToolSet:
    """``put``/``get`` on a dict of this episode's: the notes server's two tools as Python functions."""
    store: dict[str, str] = {}

    def put(key: str, value: str) -> str:
        """Store value under key, replacing what was there."""
        store[key] = value
        return "ok"

    def get(key: str) -> str:
        """The value stored under key."""
        return store[key]

    return ToolSet([put, get])


def recall_player(calls: int) -> Callable[[dict[str, Any], list[dict[str, str]]], str]:
    """``calls`` tool calls, one a turn (a ``put`` of the value, then ``get``s of its key), then the value."""

    def player(task: dict[str, Any], messages: list[dict[str, str]]) -> str:
        turn = len(messages) // 2 - 1  # system + question, then assistant/user pairs
        if turn == 0:
            call = {"name": "put", "arguments": {"key": task["key"], "value": task["value"]}}
        elif turn < calls:
            call = {"name": "get", "arguments": {"key": task["key"]}}
        else:
            return task["value"]
        return f"<tool_call>{json.dumps(call)}</tool_call>"

    return player


def play_episodes(make_env: Callable[[], Any], episodes: int, calls: int, chat: ChatTokens) -> float:
    """Seconds to play ``episodes`` concurrent episodes of ``calls`` tool calls each; every one checked."""
    tasks = [{"key": "k", "value": f"v{i}"} for i in range(episodes)]
    limits = EpisodeLimits(max_turns=calls + 1, turn_tokens=96, max_episode_tokens=4096, step_timeout_s=120.0)
    start = time.perf_counter()
    played = asyncio.run(run_episodes(make_env, tasks, ScriptedTurns(recall_player(calls), chat), chat, limits))
    elapsed = time.perf_counter() - start
    for episode in played:
        if episode.error or episode.rewards != {"correct": 1.0} or episode.tool_calls != calls:
            raise AssertionError(f"episode {episode.task_index} went wrong: {episode.error or episode.texts}")
        if episode.invalid_tool_calls:
            raise AssertionError(f"episode {episode.task_index} made invalid calls: {episode.invalid_tool_calls}")
    return elapsed


def measure_episodes(url: str, calls: int, chat: ChatTokens, args: argparse.Namespace) -> dict[str, Any]:
    contenders = {
        PYTHON: lambda: ToolEnv(RecallTask(), store_tools()),
        HTTP: lambda: McpToolEnv(RecallTask(), url),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(args.episode_repeats + 1):  # round 0 warms up
        for name in list(contenders) if round_ % 2 else list(contenders)[::-1]:
            elapsed = play_episodes(contenders[name], args.episodes, calls, chat)
            if round_:
                times[name].append(elapsed)
    row: dict[str, Any] = {"tool_calls": calls}
    for name, seconds in times.items():
        median = statistics.median(seconds)
        row[name] = {"episodes": args.episodes, "episodes_per_s": args.episodes / median, "times": seconds}
    if args.stdio_episodes > 0:
        seconds = [
            play_episodes(lambda: McpToolEnv(RecallTask(), NOTES_STDIO), args.stdio_episodes, calls, chat)
            for _ in range(args.stdio_repeats)
        ]
        median = statistics.median(seconds)
        row[STDIO] = {"episodes": args.stdio_episodes, "episodes_per_s": args.stdio_episodes / median, "times": seconds}
    for name in (HTTP, STDIO):
        if name in row:
            row[name]["vs_python"] = row[name]["episodes_per_s"] / row[PYTHON]["episodes_per_s"]
    return row


# -- the run ------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 64], help="concurrent sessions (part 1)")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds each timed round calls (part 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds after the warm-up (part 1, median)")
    parser.add_argument("--episode-repeats", type=int, default=3, help="timed rounds after the warm-up (part 2)")
    parser.add_argument("--episodes", type=int, default=64, help="concurrent episodes (part 2)")
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 4], help="tool calls per episode (part 2)")
    parser.add_argument("--stdio-episodes", type=int, default=16, help="episodes over stdio; 0 leaves it out")
    parser.add_argument("--stdio-repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "mcp_tool_calls.json")
    args = parser.parse_args()

    started = time.perf_counter()
    server, url = start_notes_server()
    try:
        print("part 1: tool round trips (put + get) on one streamable-HTTP notes server, one asyncio loop")
        print(
            f"{'sessions':>8} | {BARE + ' calls/s':>24} | {RLFABRIC + ' calls/s':>27} | rlfabric / bare (rounds) | "
            "client CPU ms/call, bare vs rlfabric"
        )
        trips = []
        for sessions in args.sessions:
            row = measure_round_trips(url, sessions, args)
            trips.append(row)
            print(
                f"{sessions:>8} | {row[BARE]['calls_per_s']:>24.0f} | {row[RLFABRIC]['calls_per_s']:>27.0f} | "
                f"{row['ratio']:.2f} ({min(row['round_ratios']):.2f}-{max(row['round_ratios']):.2f}){'':>8} | "
                f"{row[BARE]['client_cpu_ms_per_call']:.2f} vs {row[RLFABRIC]['client_cpu_ms_per_call']:.2f}",
                flush=True,
            )
        print(f"\npart 2: {args.episodes} concurrent scripted episodes, k tool calls then the answer")
        print(f"{'k':>3} | {'contender':<18} | {'episodes':>8} | {'episodes/s':>10} | vs Python functions")
        chat = ChatTokens(build_char_tokenizer(TOOL_ALPHABET))
        episodes = []
        for calls in args.calls:
            row = measure_episodes(url, calls, chat, args)
            episodes.append(row)
            for name in (PYTHON, HTTP, STDIO):
                if name in row:
                    r = row[name]
                    ratio = f"{r['vs_python']:.2f}x" if "vs_python" in r else "1.00x (anchor)"
                    print(f"{calls:>3} | {name:<18} | {r['episodes']:>8} | {r['episodes_per_s']:>10.1f} | {ratio}")
    finally:
        server.kill()
        server.wait()
    report = {
        "benchmark": "mcp_tool_calls",
        "date": date.today().isoformat(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "mcp": _version("mcp"),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "round_trips": trips,
        "episodes": episodes,
        "wall_s": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out} ({report['wall_s']:.0f} s)")


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
