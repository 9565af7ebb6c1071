"""Environment registry: names and spec strings -> env factories.

Specs, tried in this order:
  * a name given to ``register_env`` in this process (or shipped with a registry snapshot);
  * ``gym:<id>`` for any Gymnasium id (MuJoCo ones included);
  * ``pettingzoo:<family>.<name>`` (``pettingzoo:classic.tictactoe_v3``) or PettingZoo's registry id
    (``pettingzoo:classic/tictactoe-v3``): a PettingZoo env, made through PettingZoo's registry where the id is
    registered, else by the module ``pettingzoo.<family>.<name>``;
  * a name from the ``rlfabric.envs`` entry-point group of installed packages;
  * ``package.module:factory`` for any importable callable;
  * ``package:module`` where ``package.module`` is a PettingZoo env module, one with ``parallel_env`` and/or
    ``env`` functions (``mpe2:simple_spread_v3``).

A PettingZoo spec makes the Parallel env when the registry or module offers one (and the env does not declare
itself unparallelizable), else the AEC env. PettingZoo envs train with a multi_agent config
(``make_multi_agent_env``); ``make_env`` builds Gymnasium envs.

Runners on other processes and nodes get the driver's registrations through ``snapshot()``: the factories are
serialized by value when their module is not installed (a test file, a notebook, ``__main__``), so a remote worker
never needs to import the user's script. Ids a user module adds to Gymnasium's registry (``gymnasium.register``)
travel the same way, and ``gym:<id>`` finds them on the runners.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.metadata
import pkgutil
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import gymnasium as gym
import numpy as np
from gymnasium.envs.registration import EnvSpec, load_env_creator

from rlfabric import shipping
from rlfabric.config import ConfigError
from rlfabric.reward_shaping import missing_component_words

if TYPE_CHECKING:
    from pettingzoo import AECEnv, ParallelEnv

EnvFactory = Callable[..., Any]  # a gymnasium.Env, a PettingZoo AECEnv or ParallelEnv, or a text env
ENTRY_POINT_GROUP = "rlfabric.envs"
PETTINGZOO_PREFIX = "pettingzoo:"
MULTI_AGENT_HINT = "a PettingZoo env: it trains with a multi_agent config (see docs/multi_agent.md)"

_REGISTRY: dict[str, EnvFactory] = {}


class EnvNotFoundError(ConfigError):
    """An env spec that names nothing this process can build."""


def register_env(name: str, factory: EnvFactory) -> None:
    """Register ``factory(**kwargs)`` under ``name`` for this driver and all its workers: a ``gymnasium.Env``
    (PPO), a PettingZoo ``AECEnv`` or ``ParallelEnv`` (a multi_agent config) or a text env (``rlfabric.text_env``:
    ``reset(task)``, ``step(text)``)."""
    if not isinstance(name, str) or not name or name.startswith(("gym:", PETTINGZOO_PREFIX)):
        raise ValueError(
            f"register_env: name {name!r} is not valid: a non-empty string not starting with 'gym:' or 'pettingzoo:'"
        )
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


# ---------------------------------------------------------------------------------------------------------
# PettingZoo


@dataclass(frozen=True)
class PettingZooFactory:
    """Makes a PettingZoo env: ``pettingzoo.make(api, registry_id, **kwargs)`` when ``registry_id`` is set, else
    ``module.parallel_env(**kwargs)`` (api "parallel") or ``module.env(**kwargs)`` (api "aec")."""

    spec: str
    api: Literal["parallel", "aec"]
    registry_id: str | None = None
    module: str | None = None

    def __call__(self, **kwargs: Any) -> AECEnv | ParallelEnv:
        if self.registry_id is not None:
            import pettingzoo

            return pettingzoo.make(self.api, self.registry_id, **kwargs)
        assert self.module is not None
        module = importlib.import_module(self.module)
        return getattr(module, "parallel_env" if self.api == "parallel" else "env")(**kwargs)


def is_pettingzoo_env(env: Any) -> bool:
    """Whether ``env`` is a PettingZoo ``AECEnv`` or ``ParallelEnv`` (wrappers included)."""
    if "pettingzoo" not in sys.modules:  # nothing imported PettingZoo, so nothing here can be one of its envs
        return False
    from pettingzoo import AECEnv, ParallelEnv

    return isinstance(env, (AECEnv, ParallelEnv))


def _is_pettingzoo_class(obj: Any) -> bool:
    if not isinstance(obj, type) or "pettingzoo" not in sys.modules:
        return False
    from pettingzoo import AECEnv, ParallelEnv

    return issubclass(obj, (AECEnv, ParallelEnv))


def _parallelizable(module: ModuleType) -> bool:
    """False only when the module's env class declares ``metadata["is_parallelizable"] = False``."""
    metadata = getattr(getattr(module, "raw_env", None), "metadata", None)
    return not isinstance(metadata, dict) or metadata.get("is_parallelizable", True) is not False


def _module_factory(spec: str, module: ModuleType) -> PettingZooFactory | None:
    """Parallel when ``module`` offers ``parallel_env`` and is parallelizable, else AEC from ``env``; None when it
    offers neither."""
    if callable(getattr(module, "parallel_env", None)) and _parallelizable(module):
        return PettingZooFactory(spec, "parallel", module=module.__name__)
    if callable(getattr(module, "env", None)):
        return PettingZooFactory(spec, "aec", module=module.__name__)
    return None


def _import_module(name: str) -> ModuleType | None:
    """The module, or None when it does not exist; an ImportError raised inside an existing module propagates."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if exc.name is not None and name.startswith(exc.name):
            return None
        raise


def _pettingzoo_ids(rest: str) -> tuple[str, str]:
    """(registry id, dotted module form) of what follows ``pettingzoo:``: ``classic.tictactoe_v3`` and
    ``classic/tictactoe-v3`` both give ("classic/tictactoe-v3", "classic.tictactoe_v3")."""
    if "/" in rest:
        family, _, name = rest.rpartition("/")
    else:
        family, _, name = rest.rpartition(".")
    name_rid = re.sub(r"_v(\d+)$", r"-v\1", name)
    name_mod = re.sub(r"-v(\d+)$", r"_v\1", name)
    return (f"{family}/{name_rid}" if family else name_rid), (f"{family}.{name_mod}" if family else name_mod)


def _pettingzoo_registered(api: str, registry_id: str) -> str | None:
    """The full id PettingZoo's ``api`` registry has for ``registry_id`` (unversioned: the latest), or None."""
    import pettingzoo

    if not hasattr(pettingzoo, "spec"):  # PettingZoo before 1.27 has no registry
        return None
    from pettingzoo.env_registry.exceptions import PettingZooRegistryError

    try:
        return str(pettingzoo.spec(api, registry_id).id)  # type: ignore[arg-type]
    except PettingZooRegistryError:
        return None


def _pettingzoo_factory(spec: str, field: str) -> PettingZooFactory:
    """``pettingzoo:<family>.<name>`` or ``pettingzoo:<registry id>``, or one EnvNotFoundError with close matches."""
    import pettingzoo

    rest = spec[len(PETTINGZOO_PREFIX) :]
    registry_id, dotted = _pettingzoo_ids(rest)
    parallel_id = _pettingzoo_registered("parallel", registry_id)
    if parallel_id is not None:
        entry = pettingzoo.spec("parallel", parallel_id).entry_point
        module = _import_module(entry.partition(":")[0]) if isinstance(entry, str) else None
        if module is None or _parallelizable(module):
            return PettingZooFactory(spec, "parallel", registry_id=parallel_id)
    aec_id = _pettingzoo_registered("aec", registry_id)
    if aec_id is not None:
        return PettingZooFactory(spec, "aec", registry_id=aec_id)
    if dotted.split(".")[0] == "mpe":
        raise EnvNotFoundError(
            f"{field} = {spec!r} is not valid: PettingZoo's MPE envs moved to the mpe2 package: "
            f"use mpe2:{dotted.split('.')[-1]}"
        )
    module = _import_module(f"pettingzoo.{dotted}") if re.fullmatch(r"[\w.]+", dotted) else None
    factory = _module_factory(spec, module) if module is not None else None
    if factory is not None:
        return factory
    raise EnvNotFoundError(f"{field} = {spec!r} is not valid: {_pettingzoo_close_matches(rest)}")


def _pettingzoo_close_matches(rest: str) -> str:
    """'no PettingZoo environment ...; did you mean ...?': registered ids whose name is close to the one asked for,
    written in the form the user wrote (``family.name_vN`` or ``family/name-vN``)."""
    import pettingzoo

    if not rest:
        return "'pettingzoo:' needs an environment, e.g. pettingzoo:classic.tictactoe_v3"
    registry_id, dotted = _pettingzoo_ids(rest)
    ids = sorted(set(getattr(pettingzoo, "aec_registry", {})) | set(getattr(pettingzoo, "parallel_registry", {})))
    if not ids:  # PettingZoo before 1.27: its env modules, pettingzoo.<family>.<name>_v<N>
        families = [m for m in pkgutil.iter_modules(pettingzoo.__path__) if m.ispkg]
        ids = [
            _pettingzoo_ids(f"{family.name}.{m.name}")[0]
            for family in families
            for m in pkgutil.iter_modules([str(Path(pettingzoo.__path__[0]) / family.name)])
            if re.search(r"_v\d+$", m.name)
        ]
    slash_form = "/" in rest or re.search(r"-v\d+$", rest) is not None
    by_name: dict[str, list[str]] = {}
    for env_id in ids:
        form = env_id if slash_form else _pettingzoo_ids(env_id)[1]
        by_name.setdefault(re.split(r"[/.]", form)[-1], []).append(form)
    asked = re.split(r"[/.]", registry_id if slash_form else dotted)[-1]
    close = [form for name in difflib.get_close_matches(asked, list(by_name), n=3) for form in by_name[name]]
    hint = f"; did you mean {', '.join(PETTINGZOO_PREFIX + c for c in close[:3])}?" if close else ""
    return f"no PettingZoo environment {rest!r} in its registry or as a module pettingzoo.{dotted}{hint}"


def _package_module_factory(spec: str, field: str) -> PettingZooFactory | None:
    """``package:module`` naming a PettingZoo env module (``mpe2:simple_spread_v3``), or None when ``package.module``
    is no module; one EnvNotFoundError when it is a module without ``parallel_env`` or ``env``."""
    package, _, module_name = spec.partition(":")
    if not re.fullmatch(r"[A-Za-z_][\w.]*", package) or not re.fullmatch(r"[A-Za-z_][\w.]*", module_name):
        return None
    module = _import_module(f"{package}.{module_name}")
    if module is None:
        parent = _import_module(package)
        names = [m.name for m in pkgutil.iter_modules(getattr(parent, "__path__", []))]
        close = difflib.get_close_matches(module_name, names, n=3)
        if close:
            raise EnvNotFoundError(
                f"{field} = {spec!r} is not valid: package {package} has no module {module_name!r}; did you mean "
                f"{', '.join(f'{package}:{c}' for c in close)}?"
            )
        return None
    factory = _module_factory(spec, module)
    if factory is None:
        raise EnvNotFoundError(
            f"{field} = {spec!r} is not valid: module {module.__name__} has no parallel_env or env function "
            "(a PettingZoo env module), and 'package.module:factory' needs a callable"
        )
    return factory


# ---------------------------------------------------------------------------------------------------------
# Resolving and making


def resolve(spec: str, field: str = "env.id") -> EnvFactory:
    """Return the factory ``spec`` names, or raise EnvNotFoundError naming ``field`` and what is available."""
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if spec.startswith("gym:"):
        env_id = spec[len("gym:") :]
        if env_id not in gym.registry:
            close = difflib.get_close_matches(env_id, list(gym.registry), n=3)
            hint = f"; did you mean {', '.join('gym:' + c for c in close)}?" if close else ""
            raise EnvNotFoundError(f"{field} = {spec!r} is not valid: no Gymnasium environment {env_id!r}{hint}")
        return _gym_factory(env_id)
    if spec.startswith(PETTINGZOO_PREFIX):
        return _pettingzoo_factory(spec, field)
    eps = _entry_points()
    if spec in eps:
        return eps[spec].load()
    factory = shipping.import_callable(spec)
    if factory is not None:
        return factory
    pettingzoo_module = _package_module_factory(spec, field)
    if pettingzoo_module is not None:
        return pettingzoo_module
    module, _, attr = spec.partition(":")
    if module and attr and "/" not in spec:  # meant as package.module:factory: say which part is missing
        raise EnvNotFoundError(
            f"{field} = {spec!r} is not valid: {shipping.why_not_importable(spec)} (nor a registered name; see "
            "`rlfabric envs list`)"
        )
    known = sorted(_REGISTRY) + sorted(eps)
    close = difflib.get_close_matches(spec, known, n=3)
    if close:
        raise EnvNotFoundError(
            f"{field} = {spec!r} is not valid: not a registered name; did you mean {', '.join(close)}? (see "
            "`rlfabric envs list`)"
        )
    raise EnvNotFoundError(
        f"{field} = {spec!r} is not valid: not a registered name"
        f"{' (' + ', '.join(known) + ')' if known else ''}, not 'gym:<id>' or 'pettingzoo:<family>.<name>', and not "
        "an importable 'package.module:factory' or PettingZoo 'package:module'; see `rlfabric envs list`"
    )


def make_env(spec: str, kwargs: dict[str, Any] | None = None, field: str = "env.id") -> gym.Env:
    """The Gymnasium env ``spec`` names, built with ``kwargs``; a TypeError naming the spec for anything else."""
    factory = resolve(spec, field)
    if isinstance(factory, PettingZooFactory):
        raise TypeError(f"{field} = {spec!r} is {MULTI_AGENT_HINT}")
    env = factory(**(kwargs or {}))
    if is_pettingzoo_env(env):
        env.close()
        raise TypeError(f"env factory for {spec!r} returned {type(env).__name__}, {MULTI_AGENT_HINT}")
    if not isinstance(env, gym.Env):
        raise TypeError(
            f"env factory for {spec!r} returned {type(env).__name__}, expected a gymnasium.Env (a text env or an "
            "agent's task trains with algo: grpo)"
        )
    return env


def gym_api_problem(env: gym.Env, seed: int) -> str | None:
    """What one ``reset(seed=seed)`` and one ``step`` of a sampled action show wrong against the Gymnasium API, in
    words, or None (``reset_problem``, then ``step_problem``). Cheap: the pre-start check of every PPO run."""
    return reset_problem(env, seed) or step_problem(env, seed)


def reset_problem(env: gym.Env, seed: int) -> str | None:
    """``env.reset(seed=seed)`` against the Gymnasium API: (obs, info) returned, obs of the observation space's shape
    and dtype kind; what is wrong in words, or None."""
    out = env.reset(seed=seed)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        return f"reset() returned {_what(out)}, not (observation, info) as the Gymnasium API does (return obs, {{}})"
    why = _observation_misfit(env.observation_space, out[0])
    return None if why is None else f"reset()'s observation {why}"


def step_problem(env: gym.Env, seed: int, info_keys: Sequence[str] = ()) -> str | None:
    """One ``env.step`` of an action sampled from its space (seeded with ``seed``), after a reset, against the
    Gymnasium API: 5 values, obs of the observation space's shape and dtype kind, a finite scalar reward, and in
    ``info`` each of ``info_keys`` (the reward components a run reads); what is wrong in words, or None."""
    env.action_space.seed(seed)
    step = env.step(env.action_space.sample())
    if not (isinstance(step, tuple) and len(step) == 5):
        return (
            f"step() returned {_what(step)}, not the 5 values (observation, reward, terminated, truncated, info) of "
            "the Gymnasium API"
        )
    if (why := _observation_misfit(env.observation_space, step[0])) is not None:
        return f"step()'s observation {why}"
    reward = step[1]
    try:
        finite = np.ndim(reward) == 0 and bool(np.isfinite(float(reward)))
    except (TypeError, ValueError):
        finite = False
    if not finite:
        return f"step()'s reward is {reward!r}, not a finite scalar"
    info = step[4] if isinstance(step[4], dict) else {}
    missing = next((key for key in info_keys if key not in info), None)
    return None if missing is None else f"step() {missing_component_words(missing, info)}"


def _what(value: Any) -> str:
    return f"{len(value)} values" if isinstance(value, tuple) else f"a {type(value).__name__}"


_DTYPE_KINDS = {"f": "f", "i": "i", "u": "i", "b": "b"}  # signed and unsigned ints are one kind here


def _observation_misfit(space: gym.Space, obs: Any) -> str | None:
    """Why ``obs`` does not fit a Box ``space`` (its shape, or its dtype's kind: float, integer, bool), or None;
    other spaces are not checked here (PPO refuses them by name: ``check_ppo_spaces``)."""
    if not isinstance(space, gym.spaces.Box):
        return None
    arr = np.asarray(obs)
    if arr.shape != space.shape:
        return f"has shape {arr.shape}; the observation space {space} has shape {space.shape}"
    if _DTYPE_KINDS.get(arr.dtype.kind) != _DTYPE_KINDS.get(space.dtype.kind):
        return f"has dtype {arr.dtype}; the observation space {space} has dtype {space.dtype}"
    return None


def make_multi_agent_env(
    spec: str, kwargs: dict[str, Any] | None = None, field: str = "env.id"
) -> AECEnv | ParallelEnv:
    """The PettingZoo ``AECEnv`` or ``ParallelEnv`` ``spec`` names, built with ``kwargs``; a ConfigError naming the
    spec when its factory returns anything else."""
    env = resolve(spec, field)(**(kwargs or {}))
    if not is_pettingzoo_env(env):
        if isinstance(env, gym.Env):
            env.close()
        raise ConfigError(
            f"{field} = {spec!r} is not valid for a multi_agent config: its factory returned {type(env).__name__}, "
            "not a PettingZoo AECEnv or ParallelEnv (pettingzoo:<family>.<name>, a PettingZoo package:module, or a "
            "factory returning one)"
        )
    return env


def is_multi_agent(spec: str, kwargs: dict[str, Any] | None = None) -> bool:
    """Whether ``spec`` builds a PettingZoo env. ``gym:`` and ``pettingzoo:`` specs, and factories that are env
    classes, are told without building; any other factory builds one env (closed again) to find out. An unknown
    spec raises EnvNotFoundError."""
    factory = resolve(spec)
    if isinstance(factory, PettingZooFactory) or _is_pettingzoo_class(factory):
        return True
    if (spec.startswith("gym:") and spec not in _REGISTRY) or (
        isinstance(factory, type) and issubclass(factory, gym.Env)
    ):
        return False
    env = factory(**(kwargs or {}))
    multi = is_pettingzoo_env(env)
    if multi or isinstance(env, gym.Env):
        env.close()
    return multi


def list_envs() -> dict[str, str]:
    """Name -> where it comes from, for everything except the (long) Gymnasium registry."""
    return shipping.describe_sources(_REGISTRY, _entry_points())


# ---------------------------------------------------------------------------------------------------------
# Shipping registrations to remote workers


# The Gymnasium ids a fresh process has once it imports this module (Gymnasium's own, and those of whatever it
# imported first): what a user module registers with ``gymnasium.register`` later is not among them.
_GYM_IDS_AT_IMPORT = frozenset(gym.registry)


def _gym_specs_to_ship() -> list[EnvSpec]:
    """The Gymnasium registrations a runner's fresh process lacks: ids registered after this module was imported
    (``gymnasium.register`` in an ``--import`` module), and ids whose entry point is a callable of a module that
    is not installed. An entry point string into a module that is not installed is resolved here, so that its
    callable travels by value (a runner on another node cannot import the user's file)."""
    shipped = []
    for env_id, spec in gym.registry.items():
        entry = spec.entry_point
        user_callable = callable(entry) and not shipping.is_installed(getattr(entry, "__module__", "") or "")
        if env_id in _GYM_IDS_AT_IMPORT and not user_callable:
            continue
        if isinstance(entry, str):
            try:
                creator = load_env_creator(entry)
            except Exception:  # noqa: BLE001 - an entry point that does not load: the runner meets it as gym.make would
                creator = None
            if creator is not None and not shipping.is_installed(getattr(creator, "__module__", "") or ""):
                spec = dataclasses.replace(spec, entry_point=creator)
        shipped.append(spec)
    return shipped


def snapshot() -> bytes:
    """Serialize this process's registrations, and the Gymnasium registrations a runner would lack
    (``_gym_specs_to_ship``); modules that are not installed travel by value."""
    specs = _gym_specs_to_ship()
    entry_points = [spec.entry_point for spec in specs if callable(spec.entry_point)]
    return shipping.dumps_by_value((dict(_REGISTRY), specs), [*_REGISTRY.values(), *entry_points])


def load_snapshot(blob: bytes) -> None:
    """Install registrations shipped from the driver (on a runner): rlfabric's, and Gymnasium ids this process
    does not have yet."""
    registrations, specs = shipping.loads(blob)
    _REGISTRY.update(registrations)
    for spec in specs:
        gym.registry.setdefault(spec.id, spec)
