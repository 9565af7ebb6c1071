"""The config machinery every schema shares: the error type, the Ray section, and typed building and checking.

``build_config`` turns nested plain data (a YAML file after overrides) into a config dataclass, checking every value
against its annotation; ``require`` is the one-line range check the schemas' validators are made of. The schemas
(``rlfabric.ppo_config``, ``rlfabric.grpo_config``) build on this module, and ``rlfabric.config`` loads a file into
whichever schema its ``algo`` names.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import traceback
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

from rlfabric.config_aliases import Alias, alias_for, aliases_under


class ConfigError(ValueError):
    """A config value that is missing, unknown, of the wrong type or out of range."""


def raised_by_user_code(exc: BaseException) -> str:
    """``Type: message (at file.py:line)``: an exception from a user's module or factory in one line, with the
    place it was raised, since the one-line error replaces the traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}{where}"


@dataclass
class RayConfig:
    # null: start a local Ray instance; "auto" or "ray://host:port" for an existing cluster.
    address: str | None = None
    # Logical CPUs for the local instance (null: enough for every actor this config asks for).
    num_cpus: int | None = None
    # Placement group strategy for all actors (null: no placement group).
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = None
    # A placement group per role, by config section: {runners: SPREAD, learner: STRICT_PACK} (PPO), {generator:
    # SPREAD, learner: STRICT_PACK, rewards: SPREAD} (GRPO). Roles not named are placed by Ray alone.
    placement: dict[str, str] = dataclasses.field(default_factory=dict)


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def check_placement(placement: dict[str, str], roles: tuple[str, ...]) -> None:
    """``ray.placement``: one line for a role this kind of run does not have or a strategy Ray does not know."""
    for role, strategy in placement.items():
        if role not in roles:
            raise ConfigError(f"ray.placement: unknown role {role!r}; this run's roles are {', '.join(roles)}")
        if strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(f"ray.placement.{role} = {strategy!r}: must be one of {', '.join(PLACEMENT_STRATEGIES)}")


# ---------------------------------------------------------------------------------------------------------
# Building a typed config from plain data


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        item = _type_name(typing.get_args(tp)[0])
        plural = {"an integer": "integers", "a number": "numbers", "a string": "strings", "a mapping": "mappings"}
        return f"a list of {plural.get(item, item)}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it in that type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{path} = {value!r} is not valid: expected {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return build_config(tp, value, path)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, path)
            except ConfigError:
                pass
        raise bad
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise bad
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise bad
        (item_tp,) = typing.get_args(tp)
        return [coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        _, val_tp = typing.get_args(tp)
        return {str(k): (v if val_tp is Any else coerce(v, val_tp, f"{path}.{k}")) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if tp is float:
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string; accept the number meant
            try:
                number = float(value)
            except ValueError:
                raise bad from None
        if number is None:
            raise bad
        if not math.isfinite(number):  # no setting means anything at inf or nan; they only poison the math
            raise ConfigError(f"{path} = {value!r} is not valid: expected a finite number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if tp is Any:
        return value
    raise TypeError(f"unsupported config annotation {tp!r} at {path}")


def _alias(key: str, path: str, algo: str | None) -> Alias | None:
    """The row for an unknown ``key`` of section ``path``: by its whole dotted path (verl's names), else by the key
    alone (TRL's and CleanRL's names, wherever they are)."""
    if not algo:
        return None
    return alias_for(f"{path}.{key}" if path else key, algo) or alias_for(key, algo)


def _key_hint(cls: type, key: str, path: str, algo: str | None, cite: bool = True) -> str:
    """What to say beside an unknown key: the rlfabric key another library's name stands for (it wins over a
    close spelling: TRL's save_steps is not total_steps), else the closest key of its section (none for a dotted
    ``key``, an entry of an unknown section)."""
    alias = _alias(key, path, algo)
    if alias is not None:
        return f" ({alias.hint(cite)})"
    hint = [] if "." in key else difflib.get_close_matches(key, [f.name for f in dataclasses.fields(cls)], n=1)
    return f" (did you mean {(f'{path}.' if path else '') + hint[0]!r}?)" if hint else ""


# Sections only a language-model config has (``rlfabric.grpo_config.LLMConfig``): in a PPO config they say the
# user meant algo: grpo.
LLM_SECTIONS = ("data", "sampling", "generator", "rewards", "grpo", "sft", "reward_model")


def _unknown_keys_error(found: list[tuple[type, str, str]], algo: str | None) -> ConfigError:
    """One line naming every unknown key of ``found`` ((section class, key, section path)), each with its hint,
    and the keys allowed where they all are. Several other libraries' names: docs/migrating.md is cited once."""
    cite = sum(_alias(key, path, algo) is not None for _, key, path in found) < 2
    named = [
        f"{(f'{path}.{key}' if path else key)!r}{_key_hint(cls, key, path, algo, cite)}" for cls, key, path in found
    ]
    sections = {cls for cls, _, _ in found}
    allowed = (
        f"allowed here: {', '.join(f.name for f in dataclasses.fields(found[0][0]))}"
        if len(sections) == 1
        else "allowed keys: docs/config.md"
    )
    keys = "key" if len(found) == 1 else "keys"
    doc = "" if cite else "; other libraries' names: see docs/migrating.md"
    llm = algo == "ppo" and any(not path and key.split(".")[0] in LLM_SECTIONS for _, key, path in found)
    doc += "; algo: ppo trains Gymnasium and PettingZoo envs, language models train with algo: grpo" if llm else ""
    return ConfigError(f"unknown config {keys} {', '.join(named)}{doc}; {allowed}")


def _unknown_entries(cls: type, key: str, path: str, value: Any, algo: str | None) -> list[tuple[type, str, str]]:
    """The unknown ``key`` of section ``cls`` (at ``path``) as one entry, or, when another library's names lie
    under it (verl's ``actor_rollout_ref: {rollout: {n: 8}}``), as its entries, each by its dotted name under
    ``key``, so each meets its own row of the alias table."""
    full = f"{path}.{key}" if path else key
    if algo and isinstance(value, dict) and value and not alias_for(full, algo) and aliases_under(full, algo):
        return [e for k, v in value.items() for e in _unknown_entries(cls, f"{key}.{k}", path, v, algo)]
    return [(cls, key, path)]


def _unknown_keys(cls: type, data: dict[str, Any], path: str, algo: str | None = None) -> list[tuple[type, str, str]]:
    """(section class, key, section path) of each key of ``data`` that ``cls`` lacks, in its sections too (so a
    file's unknown keys are named together); ``algo``: the schema's, for the alias table (``_unknown_entries``)."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    found = []
    for key, value in data.items():
        if key not in names:
            # YAML reads keys like 2048, null or yes as int, None or bool
            found += _unknown_entries(cls, str(key), path, value, algo)
        elif dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            found += _unknown_keys(hints[key], value, f"{path}.{key}" if path else key, algo)
    return found


def build_config(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """An instance of the dataclass ``cls`` from nested plain data: unknown keys, wrong types and non-finite numbers
    are ``ConfigError``s naming the dotted field (under ``path``); missing keys take the defaults. At the top
    (``path`` ""), every unknown key of the file is named in the one error, with rlfabric's key for a TRL,
    CleanRL or verl name (``rlfabric.config_aliases``; the schema's ``algo`` says which)."""
    names = {f.name for f in dataclasses.fields(cls)}
    top = not path  # a section below is checked with the whole file, except entries of a list or mapping
    algo = getattr(cls, "algo", None) if top else None  # the schema's Literal default: "grpo" or "ppo"
    algo = algo if isinstance(algo, str) else None
    unknown = (
        _unknown_keys(cls, data, path, algo) if top else [(cls, str(key), path) for key in data if key not in names]
    )
    if unknown:
        raise _unknown_keys_error(unknown, algo)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        kwargs[key] = coerce(value, hints[key], f"{path}.{key}" if path else key)
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------------------
# Range checks that types alone cannot express


def require(ok: bool, path: str, value: Any, allowed: str) -> None:
    """Raise ``ConfigError`` naming ``path``, its ``value`` and what is ``allowed`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{path} = {value!r} is not valid: {allowed}")


def positive(path: str, value: float, *, allow_zero: bool = False) -> None:
    """``require`` that ``value`` is > 0 (>= 0 with ``allow_zero``)."""
    ok = value >= 0 if allow_zero else value > 0
    require(ok, path, value, "must be >= 0" if allow_zero else "must be > 0")


def changed_keys(value: Any, default: Any, path: str) -> list[str]:
    """The dotted paths under ``path`` where the dataclass ``value`` differs from ``default`` (nested dataclasses
    walked, so the deepest key is named)."""
    if not dataclasses.is_dataclass(value) or type(value) is not type(default):
        return [path] if value != default else []
    return [
        key
        for f in dataclasses.fields(value)
        for key in changed_keys(getattr(value, f.name), getattr(default, f.name), f"{path}.{f.name}")
    ]
