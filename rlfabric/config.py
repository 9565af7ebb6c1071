"""Typed run configuration: YAML file + dotted ``key=value`` overrides, validated before any actor starts.

Every error names the field, the bad value and what is allowed, in one line (``ConfigError``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A config value that is missing, unknown, of the wrong type or out of range."""


@dataclass
class EnvConfig:
    # A registered name, "gym:<id>" or "package.module:factory".
    id: str = "gym:CartPole-v1"
    # Keyword arguments passed to the env factory (gym.make kwargs for gym: specs).
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunnersConfig:
    num_runners: int = 2
    envs_per_runner: int = 4
    # Deadline for one fragment; a runner that misses it is treated as hung, replaced, and its work requeued.
    sample_timeout_s: float = 120.0
    num_cpus: float = 1.0
    # Extra Ray resources per runner, e.g. {"rollout_node": 1} to pin runners to tagged nodes.
    resources: dict[str, float] = field(default_factory=dict)


@dataclass
class LearnerConfig:
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    # "cpu", "cuda" or "auto" (cuda when the learner actor was given a GPU).
    device: Literal["auto", "cpu", "cuda"] = "auto"


@dataclass
class ModelConfig:
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    activation: Literal["tanh", "relu"] = "tanh"
    # Initial log standard deviation of the Gaussian policy (continuous actions only).
    init_log_std: float = 0.0


@dataclass
class PPOConfig:
    # Defaults are RL Baselines3 Zoo's tuned CartPole-v1 values (the default env); examples/ has others.
    train_batch_size: int = 256
    num_epochs: int = 20
    minibatch_size: int = 256
    lr: float = 1e-3
    anneal_lr: bool = True
    gamma: float = 0.98
    gae_lambda: float = 0.8
    clip_coef: float = 0.2
    # Clip the value loss around the old values (CleanRL / baselines "clip_vloss").
    clip_value_loss: bool = False
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    normalize_advantages: bool = True
    # Stop an update's epochs early when the approximate KL exceeds this (null: never).
    target_kl: float | None = None
    normalize_obs: bool = False
    normalize_reward: bool = False
    obs_clip: float = 10.0
    reward_clip: float = 10.0


@dataclass
class TrainingConfig:
    total_env_steps: int = 150_000
    # 0: synchronous. k > 0: runners keep sampling while the learner updates; fragments made by a policy more
    # than k versions old are dropped and counted.
    max_policy_lag: int = 0
    seed: int = 0
    # Save a checkpoint every this many iterations (and always at the end); 0: only at the end.
    checkpoint_every: int = 10
    # Checkpoints kept on disk (the newest ones); 0 keeps every one.
    keep_checkpoints: int = 3
    # Stop early once episode_return_mean reaches this (null: run to total_env_steps).
    stop_return: float | None = None
    # Episodes the final policy is evaluated on (deterministic actions); 0 skips evaluation.
    eval_episodes: int = 10


@dataclass
class RayConfig:
    # null: start a local Ray instance; "auto" or "ray://host:port" for an existing cluster.
    address: str | None = None
    # Logical CPUs for the local instance (null: enough for every actor this config asks for).
    num_cpus: int | None = None
    # Placement group strategy for all actors (null: no placement group).
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = None


@dataclass
class Config:
    algo: Literal["ppo"] = "ppo"
    env: EnvConfig = field(default_factory=EnvConfig)
    runners: RunnersConfig = field(default_factory=RunnersConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    @property
    def fragment_length(self) -> int:
        """Steps each env of each runner takes per fragment."""
        return self.ppo.train_batch_size // (self.runners.num_runners * self.runners.envs_per_runner)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------------
# Building a typed Config from plain data


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it in that type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{path} = {value!r} is not valid: expected {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return _build(tp, value, path)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
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
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        _, val_tp = typing.get_args(tp)
        return {str(k): (v if val_tp is Any else _coerce(v, val_tp, f"{path}.{k}")) for k, v in value.items()}
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


def _unknown_key_error(cls: type, key: Any, path: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    key = str(key)  # YAML reads keys like 2048, null or yes as int, None or bool
    full = f"{path}.{key}" if path else key
    hint = difflib.get_close_matches(key, names, n=1)
    suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
    return ConfigError(f"unknown config key {full!r}{suggestion}; allowed here: {', '.join(names)}")


def _build(cls: type, data: dict[str, Any], path: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise _unknown_key_error(cls, key, path)
    kwargs = {}
    for key, value in data.items():
        kwargs[key] = _coerce(value, hints[key], f"{path}.{key}" if path else key)
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------------------
# Range checks that types alone cannot express


def _require(ok: bool, path: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{path} = {value!r} is not valid: {allowed}")


def validate(cfg: Config) -> Config:
    """Check value ranges and cross-field constraints; return the config unchanged."""
    r, p, t = cfg.runners, cfg.ppo, cfg.training
    _require(r.num_runners >= 1, "runners.num_runners", r.num_runners, "must be at least 1")
    _require(r.envs_per_runner >= 1, "runners.envs_per_runner", r.envs_per_runner, "must be at least 1")
    _require(r.sample_timeout_s > 0, "runners.sample_timeout_s", r.sample_timeout_s, "must be > 0")
    lc = cfg.learner
    for path, value in (
        ("runners.num_cpus", r.num_cpus),
        ("learner.num_cpus", lc.num_cpus),
        ("learner.num_gpus", lc.num_gpus),
    ):
        _require(value >= 0, path, value, "must be >= 0")
    for path, resources in (("runners.resources", r.resources), ("learner.resources", lc.resources)):
        for name, amount in resources.items():
            _require(
                name not in ("CPU", "GPU", "memory"),
                f"{path}.{name}",
                amount,
                "CPU, GPU and memory are set by num_cpus / num_gpus, not resources",
            )
            _require(amount >= 0, f"{path}.{name}", amount, "must be >= 0")
    _require(
        lc.device != "cuda" or lc.num_gpus > 0,
        "learner.device",
        lc.device,
        "'cuda' needs learner.num_gpus > 0 (Ray hides GPUs from actors that did not ask for one)",
    )
    if cfg.ray.placement_strategy is not None:  # Ray rejects empty placement-group bundles
        for path, role in (("runners", r), ("learner", lc)):
            asks = role.num_cpus > 0 or getattr(role, "num_gpus", 0) > 0 or any(role.resources.values())
            _require(asks, f"{path}.num_cpus", role.num_cpus, "must be > 0 when ray.placement_strategy is set")
    _require(
        cfg.ray.num_cpus is None or cfg.ray.num_cpus >= 1, "ray.num_cpus", cfg.ray.num_cpus, "must be >= 1 or null"
    )
    envs = r.num_runners * r.envs_per_runner
    _require(
        p.train_batch_size >= envs and p.train_batch_size % envs == 0,
        "ppo.train_batch_size",
        p.train_batch_size,
        f"must be a positive multiple of runners.num_runners * runners.envs_per_runner = {envs}",
    )
    _require(
        1 <= p.minibatch_size <= p.train_batch_size,
        "ppo.minibatch_size",
        p.minibatch_size,
        f"must be between 1 and ppo.train_batch_size ({p.train_batch_size})",
    )
    _require(p.num_epochs >= 1, "ppo.num_epochs", p.num_epochs, "must be at least 1")
    _require(p.lr > 0, "ppo.lr", p.lr, "must be > 0")
    _require(p.target_kl is None or p.target_kl > 0, "ppo.target_kl", p.target_kl, "must be > 0 or null")
    _require(0 <= p.gamma <= 1, "ppo.gamma", p.gamma, "must be in [0, 1]")
    _require(0 <= p.gae_lambda <= 1, "ppo.gae_lambda", p.gae_lambda, "must be in [0, 1]")
    _require(p.clip_coef > 0, "ppo.clip_coef", p.clip_coef, "must be > 0")
    _require(p.max_grad_norm > 0, "ppo.max_grad_norm", p.max_grad_norm, "must be > 0")
    _require(p.obs_clip > 0, "ppo.obs_clip", p.obs_clip, "must be > 0")
    _require(p.reward_clip > 0, "ppo.reward_clip", p.reward_clip, "must be > 0")
    _require(0 <= t.seed < 2**32, "training.seed", t.seed, "must be in [0, 2**32)")
    _require(t.total_env_steps >= 1, "training.total_env_steps", t.total_env_steps, "must be at least 1")
    _require(t.max_policy_lag >= 0, "training.max_policy_lag", t.max_policy_lag, "must be >= 0 (0 is sync)")
    _require(t.checkpoint_every >= 0, "training.checkpoint_every", t.checkpoint_every, "must be >= 0")
    _require(t.keep_checkpoints >= 0, "training.keep_checkpoints", t.keep_checkpoints, "must be >= 0 (0 keeps all)")
    _require(t.eval_episodes >= 0, "training.eval_episodes", t.eval_episodes, "must be >= 0")
    _require(
        len(cfg.model.hidden_sizes) >= 1 and all(h >= 1 for h in cfg.model.hidden_sizes),
        "model.hidden_sizes",
        cfg.model.hidden_sizes,
        "must be a non-empty list of positive integers",
    )
    return cfg


# ---------------------------------------------------------------------------------------------------------
# Loading


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
        return validate(_build(Config, data))
    from rlfabric.grpo_config import LLMConfig, validate_llm

    ppo_keys = sorted({"env", "runners", "ppo"} & data.keys())  # sections only a PPO config has
    if "algo" not in data and ppo_keys:
        raise ConfigError(
            f"config key {ppo_keys[0]!r} belongs to a PPO config: add 'algo: ppo' "
            f"(without it, algo is {DEFAULT_ALGO!r})"
        )
    return validate_llm(_build(LLMConfig, data))


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
