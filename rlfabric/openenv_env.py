"""OpenEnvTextEnv: an OpenEnv environment as a text env (``rlfabric.text_env``), played through the run's
``OpenEnvHost`` actor (``rlfabric.actors.openenv_host``), which holds the library's client sessions.

``reset(task)`` opens the episode's session and resets the server's environment with the task row's fields
(``reset(**task)``); ``step(text)`` sends the model's turn as the action ``{action_key: text}``. The observation's
``observation_key`` field is what the model is shown. Each step's rewards: the environment's scalar ``reward``
under ``reward_component``, and the numeric entries of its ``metadata`` named in ``components``; ``done`` ends the
episode. ``close`` ends the session (the server's environment instance with it). ``OpenEnvToolEnv`` adds the
environment's MCP tools, listed and called through the library's MCP client.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

import ray

from rlfabric.text_env import TextStep
from rlfabric.tool_env import ToolEnv, tools_prompt
from rlfabric.tools import Tool, ToolSet


@functools.cache
def _host(name: str) -> Any:
    return ray.get_actor(name)  # looked up once per process, not per episode


class OpenEnvTextEnv:
    """See the module docstring. ``host_name``: the named ``OpenEnvHost`` actor."""

    def __init__(
        self,
        host_name: str,
        action_key: str = "text",
        observation_key: str = "text",
        reward_component: str = "reward",
        components: list[str] | None = None,
    ) -> None:
        self.host = _host(host_name)
        self.action_key, self.observation_key = action_key, observation_key
        self.reward_component = reward_component
        self.components = list(components or [])
        self.session = uuid.uuid4().hex  # unique across the run's processes and nodes

    def _text(self, result: dict[str, Any]) -> str:
        observation = result["observation"]
        if self.observation_key not in observation:
            raise ValueError(
                f"env.openenv.observation_key = {self.observation_key!r}: the observation has "
                f"{', '.join(sorted(observation)) or 'no fields'}"
            )
        return str(observation[self.observation_key])

    async def reset(self, task: dict[str, Any]) -> str:
        return self._text(await self.host.reset.remote(self.session, dict(task)))

    async def step(self, action: str) -> TextStep:
        result = await self.host.step.remote(self.session, {self.action_key: action})
        rewards = {self.reward_component: float(result["reward"] or 0.0)}
        for name in self.components:
            value = result["metadata"].get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rewards[name] = float(value)
        return TextStep(self._text(result), rewards, terminated=result["done"])

    async def close(self) -> None:
        await self.host.close.remote(self.session)

    async def tools(self) -> list[Tool]:
        """The session's tools, as ``Tool`` objects whose functions call them on the server."""
        listed = await self.host.list_tools.remote(self.session)
        return [Tool(t["name"], t["description"], t["input_schema"], self._caller(t["name"])) for t in listed]

    def _caller(self, name: str) -> Any:
        async def call(**arguments: Any) -> str:
            out = await self.host.call_tool.remote(self.session, name, arguments)
            if out["error"] is not None:
                raise RuntimeError(out["error"])
            return str(out["text"])

        call.__name__ = name
        return call

    async def answer(self, text: str) -> TextStep:
        return await self.step(text)  # a turn without a tool call is the environment's action


class OpenEnvToolEnv(ToolEnv):
    """An OpenEnv environment whose MCP tools the agent calls (``env.openenv.tools``): a ``ToolEnv`` over
    ``OpenEnvTextEnv``. At ``reset`` the session's tools are listed into the system message; a turn with tool calls
    gets their results, a turn without one is sent to the environment as its action (its reward and ``done``)."""

    def __init__(self, host_name: str, parser: str = "hermes", **kwargs: Any) -> None:
        self.episode = OpenEnvTextEnv(host_name, **kwargs)
        super().__init__(self.episode, ToolSet([]), parser)

    async def reset(self, task: dict[str, Any]) -> str:
        observation = await self.episode.reset(task)
        self.tools = ToolSet(await self.episode.tools())
        self.system_prompt = tools_prompt(self.tools)
        return observation

    async def close(self) -> None:
        await self.episode.close()
