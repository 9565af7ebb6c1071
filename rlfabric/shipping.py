"""Shipping user code to remote workers, shared by every registry (envs, rewards).

A registration made on the driver must work in a Ray worker that cannot import the user's script (a test file,
a notebook, ``__main__``). ``dumps_with_user_code`` pickles a registry so that the modules defining its callables,
and every not-installed module those reach, travel by value; installed modules (and rlfabric) travel by reference.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from ray import cloudpickle


def import_callable(spec: str) -> Any | None:
    """The callable a ``package.module:attr`` spec names, or None when the spec names nothing importable.

    An ImportError raised *inside* an existing module propagates: that error is the one the user needs to see.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        return None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name is not None and (exc.name == module_name or module_name.startswith(exc.name + ".")):
            return None  # no such module: the spec is not a module path
        raise
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if callable(obj) else None


def why_not_importable(spec: str) -> str:
    """Why a ``package.module:function`` spec that ``import_callable`` did not resolve names nothing: the function
    its module lacks, or the module that is missing."""
    module, _, attr = spec.partition(":")
    if module_exists(module):
        found = vars(sys.modules[module]) if module in sys.modules else {}  # import_callable imported it
        names = [n for n, value in found.items() if not n.startswith("_") and callable(value)]
        close = difflib.get_close_matches(attr, names, n=1)
        return f"module {module!r} has no function {attr!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
    as_module = module.removesuffix(".py").replace("/", ".")
    if as_module != module and module_exists(as_module):  # a file path where a module name goes
        return f"no module {module!r}: a module is named without '.py' or slashes ('{as_module}:{attr}')"
    return f"no module {module!r} in the current directory or on the Python path"


def module_exists(module_name: str) -> bool:
    """Whether ``module_name`` (dotted) can be found on the Python path, without importing it."""
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):  # a parent package that is missing, or an empty name
        return False


def _installed_roots() -> list[Path]:
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    return [Path(r).resolve() for r in roots]


def is_installed(module_name: str) -> bool:
    """True when remote workers can import the module by name: stdlib, site-packages, or rlfabric itself."""
    if module_name.split(".")[0] == "rlfabric":
        return True
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if module is None or path is None:
        return module_name in sys.builtin_module_names
    resolved = Path(path).resolve()
    return any(root in resolved.parents for root in _installed_roots())


def _callables_inside(fn: Any) -> list[Any]:
    """The callable plus what a partial or bound method wraps, whose modules must travel too."""
    out = [fn]
    while True:
        inner = getattr(out[-1], "func", None) or getattr(out[-1], "__func__", None)
        if inner is None or inner in out:
            return out
        out.append(inner)


def user_modules(callables: Iterable[Any]) -> dict[str, ModuleType]:
    """Modules that remote workers may be unable to import: the callables' own, and every not-installed module
    those reach through their globals (a helper module holding the env class), transitively."""
    found: dict[str, ModuleType] = {}
    queue = [getattr(obj, "__module__", None) for fn in callables for obj in _callables_inside(fn)]
    while queue:
        name = queue.pop()
        if not name or name in found or name not in sys.modules or is_installed(name):
            continue
        module = sys.modules[name]
        found[name] = module  # __main__ is scanned for what it imports; cloudpickle ships it by value anyway
        for value in vars(module).values():
            queue.append(value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None))
    found.pop("__main__", None)
    return found


def dumps_with_user_code(registrations: dict[str, Any]) -> bytes:
    """Pickle a name -> callable mapping; the modules of callables that are not installed travel by value."""
    return dumps_by_value(dict(registrations), registrations.values())


def dumps_by_value(payload: Any, callables: Iterable[Any]) -> bytes:
    """Pickle ``payload``, which holds ``callables``: the modules of those that are not installed travel by
    value."""
    by_value = user_modules(callables).values()
    for module in by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(payload)
    finally:
        for module in by_value:
            cloudpickle.unregister_pickle_by_value(module)


def loads(blob: bytes) -> dict[str, Any]:
    return cloudpickle.loads(blob)


def describe_sources(registrations: dict[str, Any], entry_points: dict[str, Any]) -> dict[str, str]:
    """Name -> where it comes from: a registration in this process, or an installed package's entry point."""
    out = {
        name: f"registered ({fn.split(':')[0] if isinstance(fn, str) else getattr(fn, '__module__', '?')})"
        for name, fn in registrations.items()
    }
    for name, ep in entry_points.items():
        dist = ep.dist.name if ep.dist is not None else "?"
        out.setdefault(name, f"entry point {ep.value} (package {dist})")
    return out
