"""Agent functions as envs: ``async def run(task, client) -> reward components``, played through the endpoint.

An agent is any coroutine function that takes a task row and an ``openai.AsyncOpenAI`` client and returns its
episode's rewards (a dict of named components, or one number, named ``reward``). It may call the model as often
as it likes, with tools, and run its own tools between calls; the endpoint (``rlfabric.openai_endpoint``)
records every call's exact tokens into the episode's trace. ``register_agent(name, fn)`` names one; a
``package.module:function`` spec needs no registration.

An agent runs on the rollout worker's event loop beside the endpoint, so it must not block it: an async client,
awaited I/O (a blocking call stalls every episode of the worker, and the deadline cannot fire until it returns).

``play_agent`` runs one episode under a deadline. Bad agent code costs only its episode, recorded with why: it
raised (the exception), hung (the deadline), never called the model, or returned something that is not rewards.
Calls it makes after its episode ended are refused by the endpoint (404) and counted there.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rlfabric import shipping
from rlfabric.agent_trace import AgentTrace
from rlfabric.config import ConfigError

Agent = Callable[[dict[str, Any], Any], Awaitable[Any]]

_AGENTS: dict[str, Agent | str] = {}


def register_agent(name: str, fn: Agent | str) -> None:
    """Register the agent ``fn(task, client)`` (or its ``"package.module:function"`` path) under ``name``."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"register_agent: name {name!r} is not valid: a non-empty string without ':'")
    if not callable(fn) and not (isinstance(fn, str) and ":" in fn):
        raise TypeError(f"register_agent({name!r}, ...): fn must be callable or 'package.module:function', got {fn!r}")
    _AGENTS[name] = fn


def resolve_agent(spec: str, field_name: str = "env.agent") -> Agent:
    """The agent a spec names: a registered name, or ``package.module:function``; a ConfigError naming
    ``field_name`` otherwise, or when it is not a coroutine function."""
    target = _AGENTS.get(spec, spec)
    fn = target if callable(target) else shipping.import_callable(target) if ":" in target else None
    if fn is None and ":" in target:
        raise ConfigError(f"{field_name} = {spec!r} is not valid: {shipping.why_not_importable(target)}")
    if fn is None:
        known = ", ".join(sorted(_AGENTS)) or "none registered"
        raise ConfigError(
            f"{field_name} = {spec!r}: not a registered agent ({known}) nor an importable 'package.module:function'"
        )
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{field_name} = {spec!r}: must be an async function run(task, client)")
    return fn


@dataclass
class AgentEpisode:
    """One agent episode: its trace (exact segments), its reward components, and why it failed, if it did."""

    task_index: int
    trace: AgentTrace
    rewards: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def episode_rewards(returned: Any) -> dict[str, float]:
    """What an agent returned as reward components: a dict of finite numbers, or one number (``reward``)."""
    if isinstance(returned, (int, float)) and not isinstance(returned, bool):
        returned = {"reward": returned}
    if not isinstance(returned, dict) or not returned:
        raise TypeError(f"returned {type(returned).__name__}, expected a dict of reward components or a number")
    out = {}
    for name, value in returned.items():
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"returned {name!r}: {value!r}; reward components are str -> number")
        if not math.isfinite(value):
            raise TypeError(f"returned {name!r}: {value!r}; reward components must be finite")
        out[name] = float(value)
    return out


async def play_agent(
    agent: Agent, task: dict[str, Any], task_index: int, client: Any, trace: AgentTrace, deadline_s: float
) -> AgentEpisode:
    """Run ``agent(task, client)`` to its end within ``deadline_s``; the episode with its trace (the endpoint
    fills it while the agent runs) and its rewards, or with the error that ended it. A call the policy failed
    (a lost generator) raises its error once the agent is done: the caller decides what that means, as for
    ``rlfabric.agent_loop.play``."""
    episode = AgentEpisode(task_index, trace)
    try:
        returned = await asyncio.wait_for(agent(task, client), deadline_s)
    except (asyncio.TimeoutError, TimeoutError):
        episode.error = f"the agent missed its {deadline_s:g}s episode deadline"
    except Exception as exc:  # noqa: BLE001 - the agent's own failure: its episode's, recorded
        episode.error = f"the agent raised {type(exc).__name__}: {exc}"
    else:
        try:
            episode.rewards = episode_rewards(returned)
        except TypeError as exc:
            episode.error = f"the agent {exc}"
    if trace.policy_error is not None:
        raise trace.policy_error
    if episode.error is None and trace.calls == 0:
        episode.error = "the agent made no model call"
    if episode.error is None:
        trace.add_rewards(episode.rewards)
    return episode
