"""Typed configuration for PPO (``algo: ppo``): env, runners, learner, model, PPO and training settings.

Built and validated by ``rlfabric.config.load_config`` with the rules of ``rlfabric.config_base``: unknown keys,
wrong types and out-of-range values are one-line ``ConfigError``s naming the field, before any actor starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from rlfabric.config_base import RayConfig, check_placement, require
from rlfabric.multiagent.config import MultiAgentConfig, validate_multi_agent
from rlfabric.reward_shaping import ENV_REWARD, component_metric, components_read

PPO_ROLES = ("runners", "learner")  # the roles ray.placement may name


@dataclass
class EnvConfig:
    # A registered name, "gym:<id>" or "package.module:factory".
    id: str = "gym:CartPole-v1"
    # Keyword arguments passed to the env factory (gym.make kwargs for gym: specs).
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Keys of the env's step info read as named reward components (MuJoCo's reward_forward, reward_ctrl, ...):
    # each episode's sum is logged (episode_reward_<key>) and every step's value kept in the trajectory record.
    # []: info is not read at all.
    reward_components: list[str] = field(default_factory=list)
    # {info key: weight}: train on r + sum_k (w_k - 1) * info[k] (rlfabric.reward_shaping.shaped_reward); a weight
    # of 1 leaves the env's reward as it is. A key not in reward_components is read as one. Fixed on --resume.
    reward_weights: dict[str, float] = field(default_factory=dict)


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
    # A PPO checkpoint (iter_*.pt, or a run directory: its latest) whose weights and normalizer statistics a new
    # run starts from ("": fresh weights); see rlfabric.ppo_init.
    init_from: str = ""


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
    # Value normalization (MAPPO's ValueNorm): the critic learns returns normalized by their running statistics.
    normalize_values: bool = False
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
class Config:
    algo: Literal["ppo"] = "ppo"
    env: EnvConfig = field(default_factory=EnvConfig)
    runners: RunnersConfig = field(default_factory=RunnersConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    # Games (PettingZoo envs): policies, agent -> policy mapping, critic, self-play. Ignored for Gymnasium envs.
    multi_agent: MultiAgentConfig = field(default_factory=MultiAgentConfig)

    @property
    def fragment_length(self) -> int:
        """Steps each env of each runner takes per fragment."""
        return self.ppo.train_batch_size // (self.runners.num_runners * self.runners.envs_per_runner)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def validate(cfg: Config) -> Config:
    """Check value ranges and cross-field constraints; return the config unchanged."""
    r, p, t = cfg.runners, cfg.ppo, cfg.training
    validate_reward_components(cfg.env)
    require(r.num_runners >= 1, "runners.num_runners", r.num_runners, "must be at least 1")
    require(r.envs_per_runner >= 1, "runners.envs_per_runner", r.envs_per_runner, "must be at least 1")
    require(r.sample_timeout_s > 0, "runners.sample_timeout_s", r.sample_timeout_s, "must be > 0")
    lc = cfg.learner
    for path, value in (
        ("runners.num_cpus", r.num_cpus),
        ("learner.num_cpus", lc.num_cpus),
        ("learner.num_gpus", lc.num_gpus),
    ):
        require(value >= 0, path, value, "must be >= 0")
    for path, resources in (("runners.resources", r.resources), ("learner.resources", lc.resources)):
        for name, amount in resources.items():
            require(
                name not in ("CPU", "GPU", "memory"),
                f"{path}.{name}",
                amount,
                "CPU, GPU and memory are set by num_cpus / num_gpus, not resources",
            )
            require(amount >= 0, f"{path}.{name}", amount, "must be >= 0")
    require(
        lc.device != "cuda" or lc.num_gpus > 0,
        "learner.device",
        lc.device,
        "'cuda' needs learner.num_gpus > 0 (Ray hides GPUs from actors that did not ask for one)",
    )
    check_placement(cfg.ray.placement, PPO_ROLES)
    require(
        not (cfg.ray.placement and cfg.ray.placement_strategy),
        "ray.placement",
        cfg.ray.placement,
        "is exclusive with ray.placement_strategy (one group for all actors): use one or the other",
    )
    for path, role in (("runners", r), ("learner", lc)):  # Ray rejects empty placement-group bundles
        if cfg.ray.placement_strategy is not None or path in cfg.ray.placement:
            asks = role.num_cpus > 0 or getattr(role, "num_gpus", 0) > 0 or any(role.resources.values())
            require(asks, f"{path}.num_cpus", role.num_cpus, "must be > 0 when its actors are in a placement group")
    require(cfg.ray.num_cpus is None or cfg.ray.num_cpus >= 1, "ray.num_cpus", cfg.ray.num_cpus, "must be >= 1 or null")
    envs = r.num_runners * r.envs_per_runner
    require(
        p.train_batch_size >= envs and p.train_batch_size % envs == 0,
        "ppo.train_batch_size",
        p.train_batch_size,
        f"must be a positive multiple of runners.num_runners * runners.envs_per_runner = {envs}",
    )
    require(
        1 <= p.minibatch_size <= p.train_batch_size,
        "ppo.minibatch_size",
        p.minibatch_size,
        f"must be between 1 and ppo.train_batch_size ({p.train_batch_size})",
    )
    require(p.num_epochs >= 1, "ppo.num_epochs", p.num_epochs, "must be at least 1")
    require(p.lr > 0, "ppo.lr", p.lr, "must be > 0")
    require(p.target_kl is None or p.target_kl > 0, "ppo.target_kl", p.target_kl, "must be > 0 or null")
    require(0 <= p.gamma <= 1, "ppo.gamma", p.gamma, "must be in [0, 1]")
    require(0 <= p.gae_lambda <= 1, "ppo.gae_lambda", p.gae_lambda, "must be in [0, 1]")
    require(p.clip_coef > 0, "ppo.clip_coef", p.clip_coef, "must be > 0")
    require(p.max_grad_norm > 0, "ppo.max_grad_norm", p.max_grad_norm, "must be > 0")
    require(p.ent_coef >= 0, "ppo.ent_coef", p.ent_coef, "must be >= 0 (a bonus for entropy; 0: none)")
    require(p.vf_coef >= 0, "ppo.vf_coef", p.vf_coef, "must be >= 0 (the value loss's weight)")
    require(p.obs_clip > 0, "ppo.obs_clip", p.obs_clip, "must be > 0")
    require(p.reward_clip > 0, "ppo.reward_clip", p.reward_clip, "must be > 0")
    require(0 <= t.seed < 2**32, "training.seed", t.seed, "must be in [0, 2**32)")
    require(t.total_env_steps >= 1, "training.total_env_steps", t.total_env_steps, "must be at least 1")
    require(t.max_policy_lag >= 0, "training.max_policy_lag", t.max_policy_lag, "must be >= 0 (0 is sync)")
    require(t.checkpoint_every >= 0, "training.checkpoint_every", t.checkpoint_every, "must be >= 0")
    require(t.keep_checkpoints >= 0, "training.keep_checkpoints", t.keep_checkpoints, "must be >= 0 (0 keeps all)")
    require(t.eval_episodes >= 0, "training.eval_episodes", t.eval_episodes, "must be >= 0")
    require(
        len(cfg.model.hidden_sizes) >= 1 and all(h >= 1 for h in cfg.model.hidden_sizes),
        "model.hidden_sizes",
        cfg.model.hidden_sizes,
        "must be a non-empty list of positive integers",
    )
    validate_multi_agent(cfg.multi_agent)
    return cfg


def validate_reward_components(env: EnvConfig) -> None:
    """``env.reward_components`` and ``env.reward_weights``: info keys that are non-empty, listed once, not ``env``
    (the name the env's own reward has in the trajectory record), and logged under names of their own."""
    seen: set[str] = set()
    for i, key in enumerate(env.reward_components):
        path = f"env.reward_components[{i}]"
        require(bool(key), path, key, "must be an info key, not empty")
        require(key != ENV_REWARD, path, key, "is the name of the env's own reward in the trajectory record")
        require(key not in seen, path, key, "is listed twice")
        seen.add(key)
    for key, weight in env.reward_weights.items():
        path = f"env.reward_weights.{key}"
        require(bool(key), "env.reward_weights", env.reward_weights, "has an empty key; keys are info keys")
        require(key != ENV_REWARD, path, weight, "'env' is the env's own reward; weigh its components instead")
    metrics: dict[str, str] = {}
    for key in components_read(env.reward_components, env.reward_weights):
        other = metrics.setdefault(component_metric(key), key)
        require(
            other == key,
            "env.reward_components",
            [other, key],
            f"both would be logged as {component_metric(key)} (a leading 'reward_' is left out); keep one",
        )
