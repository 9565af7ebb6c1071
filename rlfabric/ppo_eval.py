"""``rlfabric eval`` on a PPO run: play N episodes with a checkpoint's policy on the run's env, report the returns.

The public API, for a user who renders or records episodes themselves::

    from rlfabric.ppo_eval import env_action, load_policy

    policy = load_policy("runs/my_run")                 # a run's latest checkpoint, or a checkpoint .pt file
    env = policy.make_env(render_mode="rgb_array")      # the run's env (env.id, env.kwargs), kwargs added
    obs, _ = env.reset(seed=0)
    obs, reward, terminated, truncated, _ = env.step(env_action(env.action_space, policy.act(obs)))

The policy acts as the run's runners do (``rlfabric.policies.neural.NeuralNetPolicy``: the actor in numpy, the
observations normalized with the statistics the checkpoint holds); the checkpoint is read as a frozen game policy
is (``rlfabric.game_driver.frozen_weights``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from rlfabric import registry
from rlfabric.config import Config, ConfigError, config_from_dict
from rlfabric.driver import latest_checkpoint
from rlfabric.game_driver import frozen_weights
from rlfabric.policies.neural import NeuralNetPolicy
from rlfabric.run.log import CONFIG_FILE
from rlfabric.vector import to_env_actions

EVAL_DIR = "eval"  # RUN/eval/<checkpoint name>.json: one report per checkpoint evaluated


@dataclass
class CheckpointPolicy:
    """A PPO checkpoint's policy: ``act`` on raw observations of the run's env, ``make_env`` to build that env."""

    checkpoint: Path
    config: Config
    version: int
    policy: NeuralNetPolicy

    def act(self, obs: Any, deterministic: bool = True) -> Any:
        """The action for one raw observation: the Gaussian mean or the most likely action when ``deterministic``,
        else a sample. A continuous action is not clipped (``env_action`` maps it onto the env's space)."""
        batch = np.asarray(obs, np.float32).reshape(1, -1)
        action = self.policy.act(batch, greedy=deterministic).actions[0]
        return int(action) if self.policy.net.action.kind == "discrete" else action  # type: ignore[union-attr]

    def reseed(self, seed: int) -> None:
        """Seed the draws of sampled actions (``act`` with ``deterministic=False``)."""
        self.policy.rng = np.random.default_rng(seed)

    def make_env(self, **kwargs: Any) -> gym.Env:
        """The run's env (``env.id`` with ``env.kwargs``, ``kwargs`` added or replacing); user modules the run was
        started with must be imported first (``rlfabric eval`` imports those recorded in the run)."""
        env = self.config.env
        return registry.make_env(env.id, {**env.kwargs, **kwargs})


def env_action(space: gym.Space, action: Any) -> Any:
    """The policy's action as the runners send it to an env of ``space`` (``rlfabric.vector.to_env_actions``:
    clipped into a Box, shifted by a Discrete's ``start``); a discrete one as an int."""
    mapped = to_env_actions(space, action)
    return int(mapped) if isinstance(space, gym.spaces.Discrete) else mapped


def checkpoint_file(run_dir: str | Path | None, checkpoint: str | Path | None) -> Path:
    """The checkpoint file to read: ``checkpoint`` itself, else ``run_dir``'s latest; one ConfigError naming the
    option when there is none."""
    if checkpoint is not None:
        file = Path(checkpoint)
        if not file.is_file():
            raise ConfigError(f"--checkpoint {str(checkpoint)!r}: no such file (a PPO checkpoint is a .pt file)")
        return file
    run = Path(run_dir or ".")
    file = latest_checkpoint(run)
    if file is None:
        raise ConfigError(
            f"--run-dir {str(run_dir)!r}: no complete checkpoint under checkpoints/ (training.checkpoint_every; a "
            "run saves one at its end)"
        )
    return file


def load_policy(path: str | Path, seed: int = 0) -> CheckpointPolicy:
    """The policy of a PPO checkpoint: ``path`` is a checkpoint file or a run directory (its latest checkpoint).
    ``seed`` seeds sampled actions. One ConfigError when ``path`` holds no single-agent PPO policy."""
    path = Path(path)
    file = checkpoint_file(path, None) if path.is_dir() else checkpoint_file(None, path)
    try:
        state = torch.load(file, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: say which
        raise ConfigError(f"{str(file)!r} is not a PPO checkpoint: torch.load raised {type(exc).__name__}") from None
    if not isinstance(state, dict) or "config" not in state:
        raise ConfigError(f"{str(file)!r} is not a PPO checkpoint (no config in it)")
    if "learners" in state:
        raise ConfigError(
            f"{str(file)!r} is a multi-agent game's checkpoint: rlfabric eval plays single-agent PPO runs (a game "
            "evaluates its policies against baselines during training: multi_agent.eval_opponents)"
        )
    cfg = config_from_dict(state["config"])
    weights = frozen_weights(str(file), None, "--checkpoint")
    policy = NeuralNetPolicy(cfg.ppo.obs_clip, seed)
    policy.set_weights(weights)
    return CheckpointPolicy(file, cfg, int(weights["version"]), policy)


def play_episodes(policy: CheckpointPolicy, episodes: int, seed: int, deterministic: bool = True) -> dict[str, Any]:
    """``episodes`` episodes on one env of the run, episode i reset with ``seed + i``; their returns and lengths."""
    env = policy.make_env()
    returns: list[float] = []
    lengths: list[int] = []
    try:
        for i in range(episodes):
            obs, _ = env.reset(seed=seed + i)
            total, steps, done = 0.0, 0, False
            while not done:
                action = env_action(env.action_space, policy.act(obs, deterministic))
                obs, reward, terminated, truncated, _ = env.step(action)
                total, steps, done = total + float(reward), steps + 1, bool(terminated or truncated)
            returns.append(total)
            lengths.append(steps)
    finally:
        env.close()
    return {"episode_returns": returns, "episode_lengths": lengths}


def eval_report(policy: CheckpointPolicy, played: dict[str, Any], seed: int, deterministic: bool) -> dict[str, Any]:
    """The report written and printed: what was evaluated, and the returns' and lengths' mean and std."""
    returns, lengths = np.asarray(played["episode_returns"]), np.asarray(played["episode_lengths"])
    return {
        "checkpoint": str(policy.checkpoint),
        "env": policy.config.env.id,
        "env_kwargs": policy.config.env.kwargs,
        "policy_version": policy.version,
        "actions": "deterministic" if deterministic else "sampled",
        "seed": seed,
        "episodes": len(returns),
        "return_mean": float(returns.mean()),
        "return_std": float(returns.std()),
        "length_mean": float(lengths.mean()),
        "length_std": float(lengths.std()),
        **played,
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as the command prints it."""
    lines = [
        "\n== rlfabric eval (PPO) ==",
        f"  {'checkpoint':<16} {report['checkpoint']} (policy version {report['policy_version']})",
        f"  {'env':<16} {report['env']}",
        f"  {'episodes':<16} {report['episodes']} ({report['actions']} actions, seeds {report['seed']}..)",
        f"  {'return':<16} {report['return_mean']:.2f} +- {report['return_std']:.2f}",
        f"  {'length':<16} {report['length_mean']:.1f} +- {report['length_std']:.1f}",
        f"  {'returns':<16} {', '.join(f'{r:.2f}' for r in report['episode_returns'])}",
    ]
    return "\n".join(lines)


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run a checkpoint file sits in (``RUN/checkpoints/iter_N.pt``), or None."""
    run = checkpoint.parent.parent
    return run if (run / CONFIG_FILE).is_file() else None


def evaluate(
    file: Path, episodes: int, seed: int | None, deterministic: bool, out: Path | None
) -> tuple[dict[str, Any], Path]:
    """Play ``episodes`` with checkpoint ``file``'s policy and write the report to ``out`` (default: the run's
    ``eval/<checkpoint name>.json``); (report, its path). ``seed`` None: the run's ``training.seed``."""
    if episodes < 1:
        raise ConfigError(f"--episodes {episodes}: must be at least 1")
    policy = load_policy(file)
    seed = policy.config.training.seed if seed is None else seed
    policy.reseed(seed)  # sampled actions repeat with the seed
    report = eval_report(policy, play_episodes(policy, episodes, seed, deterministic), seed, deterministic)
    run = run_dir_of(file)
    folder = out or ((run or file.parent) / EVAL_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{file.stem}.json"
    path.write_text(json.dumps(report, indent=2, default=_jsonable) + "\n")
    return report, path


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)
