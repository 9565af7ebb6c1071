"""A stateful MCP tool server: a notes store per session, on the ``mcp`` SDK's server API (``MCPServer``).

Over stdio (``python -m rlfabric.envs.notes_server``) a process serves one session; over streamable HTTP
(``--http PORT``) one process serves many, each with its own store under its ``mcp-session-id``, so what one
episode writes no other sees either way. Tools: ``put(key, value)``, ``get(key)``, ``delete(key)``, ``keys()``; a
missing key is a tool error (``is_error``) whose message names it. ``McpToolEnv`` opens a session per episode.

As a task server (``rlfabric.envs.task_server``): a session starts with a few notes (``initial_state(seed)``:
3-5 short words under short keys); tasks are "Note cat?" (get: one lookup), "Copy note cat to owl" (get, put)
and "Rename note cat to owl" (get, put, delete).
"""

from __future__ import annotations

import random

from mcp.server.mcpserver.exceptions import ToolError

from rlfabric.envs.task_server import (
    build_task_server,
    call,
    serve,
    solved_task,
)

KEYS = ["cat", "dog", "sun", "sky", "tea", "map", "key", "box", "pen", "hat", "ink", "fox", "owl", "bee"]
VALUES = ["red", "blue", "gold", "mint", "rose", "gray", "pink", "lime", "navy", "sand"]


def initial_state(seed: int) -> dict:
    """3-5 notes, keys drawn from ``KEYS`` and values from ``VALUES`` by ``random.Random(seed)``."""
    rng = random.Random(seed)
    keys = rng.sample(KEYS, rng.randint(3, 5))
    return {"notes": {key: rng.choice(VALUES) for key in keys}}


def put(state: dict, key: str, value: str) -> str:
    """Store value under key, replacing what was there."""
    state["notes"][key] = value
    return "ok"


def get(state: dict, key: str) -> str:
    """The value stored under key."""
    if key not in state["notes"]:
        raise ToolError(f"no note {key!r}")
    return state["notes"][key]


def delete(state: dict, key: str) -> str:
    """Remove the note under key."""
    if state["notes"].pop(key, None) is None:
        raise ToolError(f"no note {key!r}")
    return "ok"


def keys(state: dict) -> str:
    """The stored keys, comma-separated, in the order they were first stored."""
    return ",".join(state["notes"])


OPS = [put, get, delete, keys]


def _lookup(state: dict, rng: random.Random) -> dict:
    key = rng.choice(sorted(state["notes"]))
    return solved_task(f"Note {key}?", state, [call("get", key=key)], OPS, answer=str)


def _copy(state: dict, rng: random.Random, rename: bool = False) -> dict | None:
    free = [key for key in KEYS if key not in state["notes"]]
    if not state["notes"] or not free:
        return None
    src, dst = rng.choice(sorted(state["notes"])), rng.choice(free)
    calls = [call("get", key=src), call("put", key=dst, value=state["notes"][src])]
    if rename:
        calls.append(call("delete", key=src))
    return solved_task(f"{'Rename' if rename else 'Copy'} note {src} to {dst}", state, calls, OPS)


def _rename(state: dict, rng: random.Random) -> dict | None:
    return _copy(state, rng, rename=True)


MAKERS = {1: [_lookup], 2: [_copy], 3: [_rename]}


server, STATES, TASK = build_task_server(
    "notes", "a key-value notes store: look up, copy and rename notes", initial_state, OPS, MAKERS
)


if __name__ == "__main__":
    serve(server)
