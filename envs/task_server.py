"""The protocol between rlfabric's stateful MCP task servers and the env that trains agents on them.

A task server is an ``MCPServer`` whose state lives per session (``SessionStates``: keyed by the HTTP
``mcp-session-id``; one key, None, over stdio) and which serves, beside the agent's tools, control tools whose
names start with ``CONTROL_PREFIX``: the env calls them, the agent never sees them (``add_control_tools``).

The agent's tools are pure functions of a session's state, ``op(state, **arguments) -> str``, raising ``ToolError``
with a message naming what was wrong; ``add_state_tools`` serves them (their type hints and docstrings become the
tools' schemas and descriptions) and ``solved_task`` replays a task's solution through the very same functions to
compute the state it leaves behind and its answer. One implementation serves the agent, the task generator and
the verifier, so they cannot disagree.

``TaskServer`` bundles a server's pure side for the env: ``initial_state(seed)``, ``make_task(state, rng, calls)``
(a task drawn from the live state the env read with ``env_state``) and ``verify(task, final_state, answer)``.
Every shipped server verifies the same way (``verify_task``): the final state must be exactly the state the
solution leaves (the asked change is there, nothing else changed) and, where the task asks a question, the answer
must match (after ``strip()``, case-insensitive).

Tools are ``async`` on purpose: they run one at a time on the server's event loop, so a check-then-change (refusing
an overdraft, say) is atomic between concurrent calls, and a session's sqlite connection stays on one thread.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import inspect
import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mcp.server.mcpserver import Context, MCPServer

CONTROL_PREFIX = "env_"  # tools the env calls, never shown to the agent

Op = Callable[..., str]  # op(state, **arguments) -> the text the agent reads
TaskMaker = Callable[[dict, random.Random], "dict | None"]  # one kind of task; None when the state has no room for it


def canonical_json(state: Mapping[str, Any]) -> str:
    """``state`` as canonical JSON: sorted keys, compact separators (equal states give equal text)."""
    return json.dumps(state, sort_keys=True, separators=(",", ":"))


def state_digest(state: Mapping[str, Any]) -> str:
    """The first 16 hex characters of sha256(canonical_json(state)): a short key of a state."""
    return hashlib.sha256(canonical_json(state).encode()).hexdigest()[:16]


def same_answer(given: str, expected: str) -> bool:
    """Whether two answers match after ``strip()``, case-insensitive."""
    return given.strip().lower() == expected.strip().lower()


def session_key(ctx: Context) -> str | None:
    """The session a call belongs to: its HTTP ``mcp-session-id``; None over stdio (one session per process)."""
    return (ctx.headers or {}).get("mcp-session-id")


class SessionStates:
    """Per-session state of an MCPServer: keyed by the HTTP mcp-session-id (one key, None, over stdio).

    A session's live state is ``load(initial_state(seed))`` (``load`` defaults to a deep copy; a server that keeps
    its state in another form, e.g. a sqlite database, loads it from the JSON form), and ``snapshot`` gives it back
    in the JSON form through ``dump`` (the identity by default)."""

    def __init__(
        self,
        initial_state: Callable[[int], dict],
        *,
        load: Callable[[dict], dict] = copy.deepcopy,
        dump: Callable[[dict], dict] | None = None,
    ) -> None:
        self.initial_state = initial_state
        self.load = load
        self.dump = dump or (lambda live: live)
        self._live: dict[str | None, dict] = {}

    def get(self, ctx: Context) -> dict:
        """This session's state; initial_state(0) until env_reset."""
        key = session_key(ctx)
        if key not in self._live:
            self._hold(ctx, key, self.load(self.initial_state(0)))
        return self._live[key]

    def reset(self, ctx: Context, seed: int) -> dict:
        """Replace this session's state by a fresh copy of initial_state(seed); return it."""
        key = session_key(ctx)
        self._hold(ctx, key, self.load(self.initial_state(seed)))
        return self._live[key]

    def _hold(self, ctx: Context, key: str | None, live: dict) -> None:
        """Hold ``live`` as session ``key``'s state, freed when the HTTP session ends even if its client never
        calls env_close (it crashed, or timed out): the SDK unwinds a connection's ``exit_stack`` when the session
        is deleted or idles out. The SDK offers no public way from a tool's context to the connection, hence the
        guarded private read; without it, env_close still frees the state."""
        self._live[key] = live
        connection = getattr(getattr(ctx.request_context, "session", None), "_connection", None)
        if key is None or connection is None or not hasattr(connection, "exit_stack"):
            return
        flag = f"rlfabric.session_states.{id(self)}"
        if not connection.state.get(flag):
            connection.state[flag] = True
            connection.exit_stack.callback(self._live.pop, key, None)

    def drop(self, ctx: Context) -> None:
        """Forget this session's state (a later call starts again from initial_state(0))."""
        self._live.pop(session_key(ctx), None)

    def snapshot(self, ctx: Context) -> dict:
        """This session's state in its JSON form."""
        return self.dump(self.get(ctx))

    def __len__(self) -> int:
        """How many sessions hold a state."""
        return len(self._live)


def add_control_tools(server: MCPServer, states: SessionStates) -> None:
    """Registers env_reset(seed: int) -> the new state's digest (state := initial_state(seed), a deep copy),
    env_state() -> the session's state as canonical JSON (sort_keys, compact separators), env_digest() ->
    state_digest(state), env_close() -> "ok" (frees the session's state; an HTTP server must not keep state of
    ended sessions: an HTTP session that ends without it is freed too), and env_sessions() -> how many sessions
    hold a state (so a test or a health check can see env_close free one)."""

    async def env_reset(seed: int, ctx: Context) -> str:
        """Put this session in the initial state of seed and return its digest (for the env, not the agent)."""
        states.reset(ctx, seed)
        return state_digest(states.snapshot(ctx))  # the first state key, without a round trip of its own

    async def env_state(ctx: Context) -> str:
        """This session's state as canonical JSON (for the env, not the agent)."""
        return canonical_json(states.snapshot(ctx))

    async def env_digest(ctx: Context) -> str:
        """A 16-hex-digit digest of this session's state (for the env, not the agent)."""
        return state_digest(states.snapshot(ctx))

    async def env_close(ctx: Context) -> str:
        """Free this session's state (for the env, not the agent)."""
        states.drop(ctx)
        return "ok"

    async def env_sessions(ctx: Context) -> str:
        """How many sessions of this server hold a state (for the env, not the agent)."""
        return str(len(states))

    for tool in (env_reset, env_state, env_digest, env_close, env_sessions):
        server.add_tool(tool, structured_output=False)


def add_state_tools(server: MCPServer, states: SessionStates, ops: Sequence[Op]) -> None:
    """Serve each ``op(state, **arguments) -> str`` as a tool of the same name that runs on the calling session's
    state; its parameters after ``state`` (with their type hints) and its docstring become the tool's schema and
    description."""
    for op in ops:
        server.add_tool(_session_tool(op, states), name=op.__name__, structured_output=False)


def _session_tool(op: Op, states: SessionStates) -> Callable[..., Any]:
    params = list(inspect.signature(op, eval_str=True).parameters.values())[1:]  # all but the state

    async def tool(ctx: Context, **arguments: Any) -> str:
        return op(states.get(ctx), **arguments)

    # The SDK reads a tool's schema from its signature and finds the Context argument by its type hint.
    ctx_param = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=Context)
    tool.__signature__ = inspect.Signature([*params, ctx_param], return_annotation=str)  # type: ignore[attr-defined]
    tool.__annotations__ = {**{p.name: p.annotation for p in params}, "ctx": Context, "return": str}
    tool.__name__ = tool.__qualname__ = op.__name__
    tool.__doc__ = inspect.getdoc(op)
    return tool


def call(name: str, **arguments: Any) -> dict:
    """One tool call of a solution: ``{"name": name, "arguments": arguments}``."""
    return {"name": name, "arguments": arguments}


def solved_task(
    question: str,
    state: dict,
    calls: list[dict],
    ops: Sequence[Op],
    answer: Callable[[str], str] | None = None,
    *,
    load: Callable[[dict], dict] = copy.deepcopy,
    dump: Callable[[dict], dict] | None = None,
) -> dict:
    """A task whose solution is ``calls``: they run through ``ops`` on a copy of ``state`` (``load``ed; ``state``
    itself is untouched), and the goal is the state they leave (its digest) and, for a question, the answer
    ``answer(last call's result)``; a task that only changes state has the answer "done" and no answer goal.
    A call that fails raises: a task generator must never emit an unsolvable task."""
    by_name = {op.__name__: op for op in ops}
    live, result = load(state), ""
    for step in calls:
        result = by_name[step["name"]](live, **step["arguments"])
    final = (dump or (lambda x: x))(live)
    expected = None if answer is None else answer(result)
    return {
        "question": question,
        "goal": {"state": state_digest(final), "answer": expected},
        "solution": {"calls": calls, "answer": "done" if expected is None else expected},
    }


def verify_task(task: dict, final_state: dict, answer: str) -> bool:
    """Success: ``final_state`` is exactly the state the task's solution leaves (its digest equals
    ``goal["state"]``: the asked change is there and nothing else changed) and, where the task asks a question
    (``goal["answer"]`` is not None), ``answer`` matches it after ``strip()``, case-insensitive."""
    goal = task["goal"]
    if state_digest(final_state) != goal["state"]:
        return False
    return goal["answer"] is None or same_answer(answer, goal["answer"])


def pick_task(makers: Sequence[TaskMaker], state: dict, rng: random.Random, calls: int, server: str) -> dict:
    """A task from one of ``makers`` (all of ``calls`` calls), tried in a random order until one fits ``state``."""
    for make in rng.sample(list(makers), len(makers)):
        task = make(state, rng)
        if task is not None:
            return task
    raise ValueError(f"{server}: no {calls}-call task fits this state")


def check_calls(calls: int, makers: Mapping[int, Sequence[TaskMaker]], server: str) -> Sequence[TaskMaker]:
    """The task makers of difficulty ``calls``; a ValueError naming the allowed range otherwise."""
    if calls not in makers:
        raise ValueError(f"{server}: calls must be in {min(makers)}..{max(makers)}, got {calls!r}")
    return makers[calls]


@dataclass(frozen=True)
class TaskServer:
    """A shipped task server: how to start it and its pure side (initial states, task generator, verifier)."""

    name: str  # "bank"
    module: str  # "rlfabric.envs.bank_server"
    description: str  # one line for `rlfabric envs list`
    initial_state: Callable[[int], dict]  # pure, deterministic in the seed, JSON-able
    make_task: Callable[[dict, random.Random, int], dict]
    verify: Callable[[dict, dict, str], bool]  # (task, final state, the agent's final answer text) -> success
    min_calls: int = 1
    max_calls: int = 4

    @property
    def command(self) -> str:
        """The command line that serves it over stdio."""
        return f"python -m {self.module}"

    @property
    def http_command(self) -> str:
        """The command line that serves it over streamable HTTP on ``{host}:{port}`` (``HttpServerProcess`` and
        ``ToolServer`` fill them in)."""
        return f"{self.command} --http {{port}} --host {{host}}"


def serve(server: MCPServer, argv: Sequence[str] | None = None) -> None:
    """Serve ``server`` over stdio, or over streamable HTTP on ``--host`` (127.0.0.1) with ``--http PORT``."""
    parser = argparse.ArgumentParser(description=f"The {server.name} task server over MCP (stdio, or HTTP).")
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on HOST:PORT")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to serve HTTP on (default 127.0.0.1; a node's address on a cluster)",
    )
    args = parser.parse_args(argv)
    if args.http is None:
        server.run()
    else:
        server.run("streamable-http", host=args.host, port=args.http)


def build_task_server(
    name: str,
    description: str,
    initial_state: Callable[[int], dict],
    ops: Sequence[Op],
    makers: Mapping[int, Sequence[TaskMaker]],
    *,
    load: Callable[[dict], dict] = copy.deepcopy,
    dump: Callable[[dict], dict] | None = None,
) -> tuple[MCPServer, SessionStates, TaskServer]:
    """A shipped task server from its parts: the ``MCPServer`` serving ``ops`` on each session's state plus the
    control tools, the ``SessionStates``, and its ``TaskServer`` (module ``rlfabric.envs.<name>_server``; a task of
    ``calls`` calls is drawn by one of ``makers[calls]``, so the difficulties are ``makers``' keys; verified by
    ``verify_task``). The server logs warnings only: the env imports the module to read its ``TaskServer``, and
    must not get the SDK's INFO logging with it."""
    states = SessionStates(initial_state, load=load, dump=dump)
    server = MCPServer(name, log_level="WARNING")
    add_state_tools(server, states, ops)
    add_control_tools(server, states)

    def make_task(state: dict, rng: random.Random, calls: int) -> dict:
        return pick_task(check_calls(calls, makers, name), state, rng, calls, name)

    spec = TaskServer(
        name=name,
        module=f"rlfabric.envs.{name}_server",
        description=description,
        initial_state=initial_state,
        make_task=make_task,
        verify=verify_task,
        min_calls=min(makers),
        max_calls=max(makers),
    )
    return server, states, spec
