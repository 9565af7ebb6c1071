"""Typed run configuration: YAML file + dotted ``key=value`` overrides, validated before any actor starts.

Every error names the field, the bad value and what is allowed, in one line (``ConfigError``). The top of the config
layer: ``algo`` picks the schema, PPO's (``rlfabric.ppo_config``) or the GRPO family's (``rlfabric.grpo_config``),
both built with the shared machinery of ``rlfabric.config_base``. Their public names are importable from here too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlfabric.config_base import ConfigError, RayConfig, build_config
from rlfabric.grpo_config import LLMConfig, validate_llm
from rlfabric.ppo_config import (
    Config,
    EnvConfig,
    LearnerConfig,
    ModelConfig,
    PPOConfig,
    RunnersConfig,
    TrainingConfig,
    validate,
)

__all__ = [
    "ALGOS",
    "DEFAULT_ALGO",
    "Config",
    "ConfigError",
    "EnvConfig",
    "LLMConfig",
    "LearnerConfig",
    "ModelConfig",
    "PPOConfig",
    "RayConfig",
    "RunnersConfig",
    "TrainingConfig",
    "apply_overrides",
    "config_from_dict",
    "dump_config",
    "load_config",
    "parse_override",
    "ppo_config_from_dict",
    "validate",
]


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into (["a", "b", "c"], parsed value); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not valid: expected key=value, e.g. ppo.lr=3e-4")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not valid: the key must be dotted names, e.g. ppo.lr")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key} = {raw!r} is not valid YAML: {exc.__class__.__name__}") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``key=value`` override set (nested keys by dots)."""
    out = yaml.safe_load(yaml.safe_dump(data)) or {}
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for depth, k in enumerate(keys[:-1]):
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(keys[: depth + 1])} is not a section")
            node = child
        node[keys[-1]] = value
    return out


DEFAULT_ALGO = "grpo"
ALGOS = ("grpo", "ppo")


def config_from_dict(data: dict[str, Any] | None) -> Any:
    """Build and validate a config from nested plain data (missing keys take defaults).

    ``algo`` picks the schema: "grpo" (LLM post-training, the default) -> ``LLMConfig``; "ppo" -> ``Config``.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping at the top level, got {type(data).__name__}")
    algo = data.get("algo", DEFAULT_ALGO)
    if algo not in ALGOS:
        raise ConfigError(f"algo = {algo!r} is not valid: expected one of {', '.join(map(repr, ALGOS))}")
    if algo == "ppo":
        return validate(build_config(Config, data))
    ppo_keys = sorted({"runners", "ppo"} & data.keys())  # sections only a PPO config has
    env = data.get("env")
    if isinstance(env, dict) and str(env.get("id", "")).startswith("gym:"):  # GRPO trains text envs, not these
        ppo_keys.insert(0, "env")
    if "algo" not in data and ppo_keys:
        raise ConfigError(
            f"config key {ppo_keys[0]!r} belongs to a PPO config: add 'algo: ppo' "
            f"(without it, algo is {DEFAULT_ALGO!r})"
        )
    return validate_llm(build_config(LLMConfig, without_default_rewards_for_episodes(data)))


def without_default_rewards_for_episodes(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``rewards.functions: []`` when it names where episodes come from (``env.id``, ``env.agent``,
    ``env.openenv``, ``env.verifiers``) and leaves ``rewards.functions`` out: there the env, agent or rubric gives
    the rewards, and the single-turn default (the arithmetic reward) would score its episodes too."""
    env = data.get("env")
    rewards = data.get("rewards")
    if not isinstance(env, dict) or (isinstance(rewards, dict) and "functions" in rewards):
        return data
    openenv, verifiers = env.get("openenv"), env.get("verifiers")
    plays = bool(env.get("id") or env.get("agent"))
    plays |= isinstance(openenv, dict) and bool(openenv.get("command") or openenv.get("url"))
    plays |= isinstance(verifiers, dict) and bool(verifiers.get("id"))
    if not plays:
        return data
    return {**data, "rewards": {**(rewards if isinstance(rewards, dict) else {}), "functions": []}}


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Any:
    """Read a YAML config (or the defaults when ``path`` is None), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return config_from_dict(apply_overrides(data, overrides or []))


def dump_config(cfg: Any) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def ppo_config_from_dict(data: dict[str, Any] | None) -> Config:
    """``config_from_dict`` for a PPO config whose data may leave out ``algo: ppo``."""
    if isinstance(data, dict) or data is None:
        data = {"algo": "ppo", **(data or {})}
    return config_from_dict(data)
