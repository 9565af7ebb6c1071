"""KeyLookup as an OpenEnv environment server with an MCP tool, written with OpenEnv's own API: an
``MCPEnvironment`` whose FastMCP server has one tool, ``lookup(key)``, reading the episode's hidden table; tools are
listed and called through OpenEnv's MCP routes, and the answer is the ``step`` action's ``text``.

``reset`` takes the task's ``key`` and ``table`` (``rlfabric.tasks``' KeyLookup rows) and asks ``Value of key
xy?``; a step's ``text`` is the answer (``mt`` or ``xy=mt``): reward 1 when it is the key's value, and the
episode ends. The observations use ``rlfabric.envs.key_lookup``'s texts, so its scripted players play it through
``rlfabric.openenv_env`` (``env.openenv.tools: true``). Serve it with
``python -m uvicorn rlfabric.envs.openenv_key_lookup:app --host 127.0.0.1 --port PORT`` in a Python that has
``openenv``.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State


class AnswerAction(Action):
    text: str = ""


class LookupObservation(Observation):
    text: str = ""


class LookupState(State):
    key: str = ""
    table: dict[str, str] = {}


class KeyLookupEnvironment(MCPEnvironment):
    """One table per session (see the module docstring)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        tools = FastMCP("key-lookup")
        env = self

        @tools.tool
        def lookup(key: str) -> str:
            """The value stored under a key of the table."""
            if key not in env._state.table:
                raise ValueError(f"no key {key}")
            return env._state.table[key]

        super().__init__(tools)
        self._state = LookupState(episode_id=str(uuid4()))

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, key: str = "", table: Any = None, **kwargs: Any
    ) -> LookupObservation:
        table = {str(k): str(v) for k, v in (table or {}).items()}
        if key not in table:
            raise ValueError(f"key = {key!r}: must be a key of the task's table")
        self._state = LookupState(episode_id=episode_id or str(uuid4()), key=key, table=table)
        return LookupObservation(text=f"Value of key {key}?", reward=0.0)

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> LookupObservation:
        said = str(getattr(action, "text", "")).strip().rsplit("=", 1)[-1].strip()
        right = said == self._state.table.get(self._state.key)
        self._state.step_count += 1
        return LookupObservation(text="Right." if right else "Wrong.", reward=float(right), done=True)

    @property
    def state(self) -> LookupState:
        return self._state


app = create_app(
    KeyLookupEnvironment,
    AnswerAction,
    LookupObservation,
    env_name="key_lookup",
    max_concurrent_envs=512,
    state_cls=LookupState,
)
