"""McpTasks: an agent env over rlfabric's stateful MCP task servers (``rlfabric.envs.task_library``).

Each task names its server and a seed (``mcp_task_rows`` samples them from the live state of fresh sessions).
``reset(task)`` opens an MCP session on the task's server (supervised: the URL its ``ToolServer`` actor gives;
else the server's command line, a process per episode), puts the session in the seed's state (``env_reset``) and
asks the task's question. Each turn's tool calls run on that session, checked against the listed schemas first
(``ToolEnv``); the first turn without a call is the answer: the env reads the session's final state
(``env_state``) and the server's verifier decides success. ``state_key()`` is the session state's digest
(``env_digest``) joined to a digest of the observation the agent is about to act on (the question, or the last
turn's tool results): what the agent acts in is the server's state and what it has just been shown, so steps
that reach the same state with the same view across a group's episodes group for step-level credit, and a
lookup (which leaves the server's state as it was) still moves the agent to a state of its own.
``close()`` ends the session, and with it the session's state on the server (an HTTP task server frees a
session's state when the session ends; ``env_close`` is there for clients that keep a session open).

Reward components: ``correct`` 1 when the verifier accepts the final state and answer (what ``eval_accuracy``
averages); ``invalid`` 1 per call the env refused (malformed, unknown tool, arguments that break the schema: call
validity); and two counts, ``calls`` (tool calls made) and ``failed_calls`` (calls the server answered with an
error or that missed their deadline), which the env weighs 0 by default (``default_reward_weights``) and which
``rewards.efficiency`` reads to penalise redundant or failing calls.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import string
from collections.abc import Sequence
from typing import Any

from rlfabric.envs.task_library import TASK_SERVERS, sample_tasks, task_server
from rlfabric.mcp_server_process import HttpServerProcess
from rlfabric.text_env import TextStep
from rlfabric.tool_env import McpToolEnv, server_address

REFUSED_KINDS = ("malformed", "unknown_tool", "invalid_arguments")  # calls that never reached the server
FAILED_KINDS = ("tool_error", "tool_timeout")  # calls the server answered with an error, or too late


class VerifiedTask:
    """What ``McpTaskEnv`` wraps: resets the session to the task's seed, asks its question, and scores an answer
    by the server's verifier on the session's final state."""

    def __init__(self, env: McpTaskEnv) -> None:
        self.env = env
        self.task: dict[str, Any] = {}

    async def reset(self, task: dict[str, Any]) -> str:
        self.task = task
        self.env.digest = await self.env.control("env_reset", {"seed": int(task["seed"])})
        return str(task["question"])

    async def answer(self, text: str) -> TextStep:
        final_state = json.loads(await self.env.control("env_state"))
        success = task_server(self.task["server"]).verify(self.task, final_state, text)
        return TextStep("Done." if success else "Wrong.", {"correct": float(success)}, terminated=True)


class McpTaskEnv(McpToolEnv):
    """See the module docstring. ``servers``: the task servers this env may open (names in ``TASK_SERVERS``; None:
    all); ``tool_servers``: their ``ToolServer`` actors (a run starts them from ``env.tool_servers``) or the URLs of
    running servers, by name;
    ``system_prompt``: None lists the task's tools and the call format, "" leaves the system message out."""

    default_reward_weights = {"calls": 0.0, "failed_calls": 0.0}

    def __init__(
        self,
        servers: Sequence[str] | str | None = None,
        tool_servers: dict[str, Any] | None = None,
        system_prompt: str | None = None,
        parser: str = "hermes",
        tool_timeout_s: float = 10.0,
        start_timeout_s: float = 30.0,
    ) -> None:
        names = list(TASK_SERVERS) if servers is None else [servers] if isinstance(servers, str) else list(servers)
        supervised = dict(tool_servers or {})
        unknown = sorted(set(names) - set(TASK_SERVERS)) + sorted(set(supervised) - set(names))
        if unknown:
            raise ValueError(f"McpTasks servers {unknown} are not task servers of this env: {sorted(TASK_SERVERS)}")
        self.addresses = {n: server_address(supervised.get(n) or task_server(n).command) for n in names}
        super().__init__(VerifiedTask(self), self.addresses[names[0]], parser, tool_timeout_s, start_timeout_s)
        self.fixed_prompt = system_prompt
        self.digest: str | None = None  # the session state's digest, while no call has happened since
        self.view = ""  # digest of the observation the agent acts on next (state_key's second half)

    async def reset(self, task: dict[str, Any]) -> str:
        name = task.get("server")
        if name not in self.addresses:
            raise ValueError(f"McpTasks task server = {name!r}: this env serves {sorted(self.addresses)}")
        self.server = self.addresses[name]
        question = await super().reset(task)
        if self.fixed_prompt is not None:
            self.system_prompt = self.fixed_prompt
        self.view = observation_digest(question)
        return question

    async def step(self, action: str) -> TextStep:
        step = await super().step(action)
        info = step.info
        if info.get("tool_calls"):
            self.digest = None  # a call may have changed the state: state_key() asks the server again
        bad = info.get("invalid_tool_calls", {})
        step.rewards["calls"] = step.rewards.get("calls", 0.0) + float(info.get("tool_calls", 0))
        step.rewards["invalid"] = step.rewards.get("invalid", 0.0) + float(sum(bad.get(k, 0) for k in REFUSED_KINDS))
        failed = float(sum(bad.get(k, 0) for k in FAILED_KINDS))
        step.rewards["failed_calls"] = step.rewards.get("failed_calls", 0.0) + failed
        self.view = observation_digest(step.observation)
        return step

    async def control(self, name: str, arguments: dict[str, Any] | None = None) -> str:
        """Call one of the server's control tools (``env_*``) on this episode's session."""
        if self.session is None:
            raise RuntimeError(f"McpTasks {name} called with no session open (reset first)")
        return await asyncio.wait_for(self.session.call(name, arguments), self.tool_timeout_s)

    async def state_key(self) -> str:
        """``"<session state digest>/<observation digest>"``: equal server states seen through equal observations
        across episodes give equal keys. The server is asked only after a turn that called tools (``env_reset``
        returned the first digest)."""
        if self.digest is None:
            self.digest = await self.control("env_digest")
        return f"{self.digest}/{self.view}"


def observation_digest(text: str) -> str:
    """12 hex digits of the SHA-1 of an observation's text: a short, equal-exactly-when-equal stand-in for it."""
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def mcp_task_rows(n: int, seed: int, servers: str = "notes,bank", min_calls: int = 1, max_calls: int = 1) -> list[dict]:
    """Tasks of ``McpTasks`` (``data.train: task:mcp?servers=notes,bank&min_calls=1&max_calls=2``): ``n`` rows
    spread round-robin over the comma-separated ``servers``, each drawn by the server's task generator from the
    live state of a fresh session (its own process here), needing ``min_calls`` to ``max_calls`` tool calls (each
    server's range clips it). A row is the task (``server``, ``seed``, ``question``, ``goal``, ``solution``,
    ``calls``) plus ``prompt``, which names it (held-out splits keep tasks apart by it), and ``answer``, the
    solution's (shown beside sampled episodes)."""
    names = [s.strip() for s in str(servers).split(",") if s.strip()]
    if not names:
        raise ValueError(f"servers = {servers!r}: name at least one of {', '.join(TASK_SERVERS)}")
    for name in names:
        if name not in TASK_SERVERS:
            raise ValueError(f"servers = {servers!r}: {name!r} is not a task server ({', '.join(TASK_SERVERS)})")
    if not isinstance(min_calls, int) or not isinstance(max_calls, int) or not 1 <= min_calls <= max_calls:
        raise ValueError(f"min_calls = {min_calls!r}, max_calls = {max_calls!r}: need integers 1 <= min <= max")
    counts = [n // len(names) + (i < n % len(names)) for i in range(len(names))]

    async def draw() -> list[list[dict]]:
        batches = []
        for k, (name, count) in enumerate(zip(names, counts, strict=True)):
            spec = task_server(name)
            low, high = max(min_calls, spec.min_calls), min(max_calls, spec.max_calls)
            if low > high:
                raise ValueError(
                    f"{name}: its tasks need {spec.min_calls} to {spec.max_calls} calls, not {min_calls}-{max_calls}"
                )
            batches.append(await sample_tasks(spec, count, seed * 1000 + k, (low, high)) if count else [])
        return batches

    batches = asyncio.run(draw())
    rows: list[dict] = []
    for i in range(max(counts, default=0)):  # interleaved, so any prefix mixes the servers
        for batch in batches:
            if i < len(batch):
                task = batch[i]
                name = f"{task['server']}#{task['seed']}: {task['question']}"
                rows.append({**task, "prompt": name, "answer": task["solution"]["answer"]})
    return rows


def tool_call_text(call: dict[str, Any]) -> str:
    """A solution call in Hermes format, compact JSON (fewer characters for a character-level model)."""
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def solution_player(task: dict[str, Any], messages: list[dict[str, str]]) -> str:
    """The scripted solver (``sft.player: rlfabric.envs.mcp_tasks:solution_player``): the task's solution calls,
    one per turn, then its answer. Its results depend on the earlier calls' only through the seeded state, which
    the generator read: replayed on a session reset to the task's seed, every call finds what it needs."""
    return solution_step(task, sum(1 for m in messages if m["role"] == "assistant"))


def solution_step(task: dict[str, Any], done: int) -> str:
    """The solution's next action after ``done`` of its steps: its next call, or its answer once all are made."""
    calls = task["solution"]["calls"]
    return tool_call_text(calls[done]) if done < len(calls) else str(task["solution"]["answer"])


def guess(rng: random.Random) -> str:
    """An answer without looking: three random letters."""
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(3))


async def check_task_server(name: str, tasks_per_level: int = 4, seed: int = 0, url: str | None = None) -> list[dict]:
    """Play ``tasks_per_level`` tasks of each difficulty of server ``name`` with the scripted solver through the
    real env (an MCP session per episode, the builtin tool tokenizer) and report, per number of calls: tasks,
    solved (the verifier's verdict) and the first failure. ``rlfabric tools check NAME`` prints it."""
    from rlfabric.agent_loop import EpisodeLimits, ScriptedTurns, run_episodes
    from rlfabric.models.chat_tokens import ChatTokens
    from rlfabric.models.hf import TOOL_ALPHABET, build_char_tokenizer

    spec = task_server(name)
    chat = ChatTokens(build_char_tokenizer(TOOL_ALPHABET))
    turns = ScriptedTurns(solution_player, chat)
    server = None if url else HttpServerProcess(name, spec.http_command)
    if server is not None:  # one process serves every episode's session: far quicker than a process each
        url = await server.start()
    report = []
    try:
        for calls in range(spec.min_calls, spec.max_calls + 1):
            tasks = await sample_tasks(spec, tasks_per_level, seed + calls, calls, url=url)
            limits = EpisodeLimits(max_turns=calls + 1, turn_tokens=512, max_episode_tokens=16384)
            episodes = await run_episodes(lambda: McpTaskEnv(name, {name: url}), tasks, turns, chat, limits)
            solved = [e.error is None and e.rewards.get("correct", 0.0) == 1.0 for e in episodes]
            first = next((i for i, ok in enumerate(solved) if not ok), None)
            failure = None
            if first is not None:
                episode = episodes[first]
                failure = episode.error or f"not verified: {tasks[first]['question']!r} -> {episode.texts}"
            report.append({"calls": calls, "tasks": len(tasks), "solved": sum(solved), "failure": failure})
    finally:
        if server is not None:
            await server.stop()
    return report


_CARELESS = random.Random(0)  # the careless player's slips: seeded, so a run's demonstrations repeat


def careless_player(task: dict[str, Any], messages: list[dict[str, str]]) -> str:
    """``solution_player`` that, on a third of its episodes, answers at once with a guess (three random letters)
    instead of calling the tools: demonstrations that teach the calls and the copying, but not always to use the
    tools, which is left to GRPO (``sft.player: rlfabric.envs.mcp_tasks:careless_player``)."""
    if not any(m["role"] == "assistant" for m in messages) and _CARELESS.random() < 1 / 3:
        return guess(_CARELESS)
    return solution_player(task, messages)


_PLAYS: dict[int, int] = {}  # how often the wasteful player has begun each task (by seed) in this process


def wasteful_player(task: dict[str, Any], messages: list[dict[str, str]]) -> str:
    """A careless solver that also re-checks: on a third of its episodes it answers at once with a guess (three
    random letters); after a solution call that was not itself a repeat, it makes the same call again with
    probability 1/2 (about a third of its episodes on one-call tasks). A repeated call changes nothing on a lookup
    and costs a call, so its successful episodes differ in their call counts: the redundancy
    ``rewards.efficiency`` penalises and step-level credit can tell apart. Meant for tasks whose calls are
    lookups or idempotent writes (a repeated transfer would move the money twice).

    Its draws depend only on the task, how often this process has begun it, and the conversation, never on the
    order in which concurrent episodes reach it: two runs with one seed get the same demonstrations."""
    said = [m["content"] for m in messages if m["role"] == "assistant"]
    seed = int(task["seed"])
    if not said:
        begun = _PLAYS.get(seed, 0)
        _PLAYS[seed] = begun + 1
        rng = random.Random(f"{seed}:{begun}")
        if rng.random() < 1 / 3:
            return guess(rng)
    rng = random.Random(f"{seed}:{said}")
    if said and said[-1].startswith("<tool_call>") and (len(said) < 2 or said[-1] != said[-2]) and rng.random() < 0.5:
        return said[-1]
    return solution_step(
        task, len(said) - sum(a == b for a, b in zip(said, said[1:], strict=False))
    )  # repeats: no step
