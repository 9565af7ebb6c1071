"""Environment registry: names and spec strings -> env factories.

Specs, tried in this order:
  * a name given to ``register_env`` in this process (or shipped with a registry snapshot);
  * ``gym:<id>`` for any Gymnasium id (MuJoCo ones included);
  * a name from the ``rlfabric.envs`` entry-point group of installed packages;
  * ``package.module:factory`` for any importable callable.

Runners on other processes and nodes get the driver's registrations through ``snapshot()``: the factories are
serialized by value when their module is not installed (a test file, a notebook, ``__main__``), so a remote worker
never needs to import the user's script.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from rlfabric import shipping
from rlfabric.config import ConfigError

EnvFactory = Callable[..., Any]  # a gymnasium.Env, or a text env (rlfabric.text_env)
ENTRY_POINT_GROUP = "rlfabric.envs"

_REGISTRY: dict[str, EnvFactory] = {}


class EnvNotFoundError(ConfigError):
    """An env spec that names nothing this process can build."""


def register_env(name: str, factory: EnvFactory) -> None:
    """Register ``factory(**kwargs)`` under ``name`` for this driver and all its workers: a ``gymnasium.Env``
    (PPO) or a text env (``rlfabric.text_env``: ``reset(task)``, ``step(text)``)."""
    if not isinstance(name, str) or not name or name.startswith("gym:"):
        raise ValueError(f"register_env: name {name!r} is not valid: a non-empty string not starting with 'gym:'")
    if not callable(factory):
        raise TypeError(f"register_env({name!r}, ...): factory must be callable, got {type(factory).__name__}")
    _REGISTRY[name] = factory


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _gym_factory(env_id: str) -> EnvFactory:
    def make(**kwargs: Any) -> gym.Env:
        return gym.make(env_id, **kwargs)

    make.__qualname__ = f"gym.make({env_id!r})"
    return make


def resolve(spec: str, field: str = "env.id") -> EnvFactory:
    """Return the factory ``spec`` names, or raise EnvNotFoundError naming ``field`` and what is available."""
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if spec.startswith("gym:"):
        env_id = spec[len("gym:") :]
        if env_id not in gym.registry:
            import difflib

            close = difflib.get_close_matches(env_id, list(gym.registry), n=3)
            hint = f"; did you mean {', '.join('gym:' + c for c in close)}?" if close else ""
            raise EnvNotFoundError(f"{field} = {spec!r} is not valid: no Gymnasium environment {env_id!r}{hint}")
        return _gym_factory(env_id)
    eps = _entry_points()
    if spec in eps:
        return eps[spec].load()
    factory = shipping.import_callable(spec)
    if factory is not None:
        return factory
    known = sorted(_REGISTRY) + sorted(eps)
    raise EnvNotFoundError(
        f"{field} = {spec!r} is not valid: not a registered name"
        f"{' (' + ', '.join(known) + ')' if known else ''}, not 'gym:<id>', and not an importable "
        "'package.module:factory'; see `rlfabric envs list`"
    )


def make_env(spec: str, kwargs: dict[str, Any] | None = None, field: str = "env.id") -> gym.Env:
    env = resolve(spec, field)(**(kwargs or {}))
    if not isinstance(env, gym.Env):
        raise TypeError(f"env factory for {spec!r} returned {type(env).__name__}, expected a gymnasium.Env")
    return env


def list_envs() -> dict[str, str]:
    """Name -> where it comes from, for everything except the (long) Gymnasium registry."""
    return shipping.describe_sources(_REGISTRY, _entry_points())


# ---------------------------------------------------------------------------------------------------------
# Shipping registrations to remote workers


def snapshot() -> bytes:
    """Serialize this process's registrations; modules that are not installed travel by value."""
    return shipping.dumps_with_user_code(_REGISTRY)


def load_snapshot(blob: bytes) -> None:
    """Install registrations shipped from the driver (on a runner)."""
    _REGISTRY.update(shipping.loads(blob))
