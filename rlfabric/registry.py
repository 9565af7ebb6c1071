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

import importlib
import importlib.metadata
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import gymnasium as gym
from ray import cloudpickle

from rlfabric.config import ConfigError

EnvFactory = Callable[..., gym.Env]
ENTRY_POINT_GROUP = "rlfabric.envs"

_REGISTRY: dict[str, EnvFactory] = {}


class EnvNotFoundError(ConfigError):
    """An env spec that names nothing this process can build."""


def register_env(name: str, factory: EnvFactory) -> None:
    """Register ``factory(**kwargs) -> gymnasium.Env`` under ``name`` for this driver and all its runners."""
    if not isinstance(name, str) or not name or name.startswith("gym:"):
        raise ValueError(f"register_env: name {name!r} is not valid: a non-empty string not starting with 'gym:'")
    if not callable(factory):
        raise TypeError(f"register_env({name!r}, ...): factory must be callable, got {type(factory).__name__}")
    _REGISTRY[name] = factory


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _import_factory(spec: str) -> EnvFactory | None:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        return None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            return None  # no such module: the spec is not a module path
        raise  # the module exists but its own imports fail: that error is the one to see
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if callable(obj) else None


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
    factory = _import_factory(spec)
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
    out = {name: f"registered ({getattr(f, '__module__', '?')})" for name, f in _REGISTRY.items()}
    for name, ep in _entry_points().items():
        dist = ep.dist.name if ep.dist is not None else "?"
        out.setdefault(name, f"entry point {ep.value} (package {dist})")
    return out


# ---------------------------------------------------------------------------------------------------------
# Shipping registrations to remote workers


def _installed_roots() -> list[Path]:
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    return [Path(r).resolve() for r in roots]


def _is_installed(module_name: str) -> bool:
    """True when remote workers can import the module by name: stdlib, site-packages, or rlfabric itself."""
    if module_name.split(".")[0] == "rlfabric":
        return True
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if module is None or path is None:
        return module_name in sys.builtin_module_names
    resolved = Path(path).resolve()
    return any(root in resolved.parents for root in _installed_roots())


def _callables_inside(factory: Any) -> list[Any]:
    """The factory plus what a partial or bound method wraps, whose modules must travel too."""
    out = [factory]
    while True:
        inner = getattr(out[-1], "func", None) or getattr(out[-1], "__func__", None)
        if inner is None or inner in out:
            return out
        out.append(inner)


def _user_modules(factories: list[Any]) -> dict[str, ModuleType]:
    """Modules that remote workers may be unable to import: the factories' own, and every not-installed module
    those reach through their globals (a helper module holding the env class), transitively."""
    found: dict[str, ModuleType] = {}
    queue = [getattr(obj, "__module__", None) for f in factories for obj in _callables_inside(f)]
    while queue:
        name = queue.pop()
        if not name or name in found or name not in sys.modules or _is_installed(name):
            continue
        module = sys.modules[name]
        found[name] = module  # __main__ is scanned for what it imports; cloudpickle ships it by value anyway
        for value in vars(module).values():
            queue.append(value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None))
    found.pop("__main__", None)
    return found


def snapshot() -> bytes:
    """Serialize this process's registrations; modules that are not installed travel by value."""
    by_value = _user_modules(list(_REGISTRY.values())).values()
    for module in by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(dict(_REGISTRY))
    finally:
        for module in by_value:
            cloudpickle.unregister_pickle_by_value(module)


def load_snapshot(blob: bytes) -> None:
    """Install registrations shipped from the driver (on a runner)."""
    _REGISTRY.update(cloudpickle.loads(blob))
