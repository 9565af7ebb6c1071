"""The text env contract: multi-turn envs whose observations and actions are text.

An episode is ``observation = env.reset(task)``, then ``env.step(action_text) -> TextStep`` until it says
terminated or truncated. ``task`` is one row of the run's task data (a dict, e.g. ``{"secret": 12}``). Either
method may be a coroutine (an env waiting on a tool server) or a plain function (run in a worker thread, so a slow
one does not stall the other episodes). Rewards come back as named components per step; the trajectory keeps them
on the turn's step span and sums them into the episode's outcome.

Text envs are registered and named like every env (``register_env``, ``package.module:factory`` specs, the
``rlfabric.envs`` entry points); ``make_text_env`` builds one and checks it keeps the contract.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import gymnasium as gym

from rlfabric import registry


@dataclass
class TextStep:
    """What one ``step`` returns: the next observation (shown to the agent unless the episode ended), reward
    components for this step, whether the episode ended (terminated) or was cut (truncated), and free info."""

    observation: str
    rewards: dict[str, float] = field(default_factory=dict)
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


# what a step that returned something else is told (a Gymnasium-style tuple is the usual mistake)
TEXT_STEP_HINT = (
    " (from rlfabric.text_env import TextStep; TextStep(observation, rewards, terminated, truncated, info))"
)


@runtime_checkable
class TextEnv(Protocol):
    """See the module docstring. ``system_prompt`` (optional attribute): a system message for every episode."""

    def reset(self, task: dict[str, Any]) -> Any: ...

    def step(self, action: str) -> Any: ...


def text_env_factory(
    spec: str, kwargs: dict[str, Any] | None = None, field_name: str = "env.id"
) -> Callable[[], TextEnv]:
    """A function that builds a fresh text env ``spec`` names, with ``kwargs``. The spec is resolved here, once
    (looking a name up among the installed entry points takes milliseconds: too slow to repeat per episode); each
    build checks that the factory returned a text env, else one clear error naming the spec."""
    factory = registry.resolve(spec, field_name)
    kwargs = dict(kwargs or {})

    def build() -> TextEnv:
        env = factory(**kwargs)
        if isinstance(env, gym.Env):
            raise TypeError(
                f"{field_name} = {spec!r} is a Gymnasium env, not a text env (reset(task) -> str, step(text) -> "
                "TextStep): Gymnasium envs train with algo: ppo"
            )
        missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
        if missing:
            raise TypeError(
                f"{field_name} = {spec!r}: its factory returned {type(env).__name__}, which has no "
                f"{' or '.join(missing)}: a text env needs reset(task) -> str and step(action) -> TextStep"
            )
        return env

    return build


def make_text_env(spec: str, kwargs: dict[str, Any] | None = None, field_name: str = "env.id") -> TextEnv:
    """The text env ``spec`` names, built once (see ``text_env_factory``)."""
    return text_env_factory(spec, kwargs, field_name)()


# Plain env methods run here, not in asyncio's default pool (a handful of threads on a small machine): a step that
# hangs past its deadline keeps its thread, and must not leave the other episodes without one.
_ENV_THREADS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="text-env")


async def call_env(method: Any, *args: Any) -> Any:
    """Call an env method (or a tool), coroutine or plain: a plain one runs in a worker thread so the loop keeps
    going."""
    if inspect.iscoroutinefunction(method):
        return await method(*args)
    result = await asyncio.get_running_loop().run_in_executor(_ENV_THREADS, method, *args)
    return await result if inspect.isawaitable(result) else result


def check_text_env(env: Any, task: dict[str, Any], action: str = "") -> str:
    """Play one turn of ``env`` on ``task`` (reset, then ``step(action)``) and check what comes back has the
    contract's types; return a one-line description, or raise TypeError naming what is wrong."""

    async def one_turn() -> tuple[Any, Any]:
        return await call_env(env.reset, task), await call_env(env.step, action)

    observation, step = asyncio.run(one_turn())
    if not isinstance(observation, str):
        raise TypeError(f"reset returned {type(observation).__name__}, expected str (the first observation)")
    if not isinstance(step, TextStep):
        raise TypeError(f"step returned {type(step).__name__}, expected a TextStep{TEXT_STEP_HINT}")
    bad = {k: v for k, v in step.rewards.items() if not isinstance(k, str) or not isinstance(v, (int, float))}
    if bad:
        raise TypeError(f"step rewards {bad} are not str -> number components")
    return f"reset -> {observation[:60]!r}; step({action!r}) -> {step.observation[:60]!r}, rewards {step.rewards}"
