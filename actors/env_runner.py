"""EnvRunner: a vector of envs plus a local copy of the policy; produces trajectory fragments.

A fragment is a trajectory record (rlfabric.trajectory) with one row per env of T steps, carrying the policy
version that produced it. Observations are stored normalized exactly as the policy saw them, so the learner's ratio is
1 before its first gradient step.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray

from rlfabric import registry
from rlfabric.models.numpy_policy import ActionSpec, obs_dim_of
from rlfabric.normalization import RunningStats, discounted_returns
from rlfabric.policies.neural import NeuralNetPolicy
from rlfabric.reward_shaping import components_read, shaped_reward
from rlfabric.trajectory import Trajectories, from_time_major
from rlfabric.vector import EnvVector


class EnvRunnerCore:
    """The runner's logic without Ray, so it can be used and tested in-process."""

    def __init__(
        self,
        env_id: str,
        env_kwargs: dict[str, Any],
        num_envs: int,
        fragment_length: int,
        seed: int,
        gamma: float,
        obs_clip: float,
        registry_blob: bytes | None = None,
        episode_id_start: int = 0,
        reward_components: Sequence[str] = (),
        reward_weights: Mapping[str, float] | None = None,
    ) -> None:
        """``episode_id_start``: the first row's episode id (the driver gives each runner its own range).
        ``reward_components`` / ``reward_weights``: the run's ``env.reward_components`` / ``env.reward_weights``
        (rlfabric.reward_shaping): the info keys read each step, and the weights of the reward trained on."""
        if registry_blob is not None:
            registry.load_snapshot(registry_blob)
        self.env_id, self.env_kwargs = env_id, env_kwargs
        self.reward_weights = dict(reward_weights or {})
        self.components = components_read(reward_components, self.reward_weights)
        envs = [registry.make_env(env_id, env_kwargs) for _ in range(num_envs)]
        self.envs = EnvVector(envs, name=env_id, components=self.components)
        first = self.envs.envs[0]
        self.obs_dim = obs_dim_of(first.observation_space)
        self.action = ActionSpec.from_space(first.action_space)
        self.fragment_length = fragment_length
        self.gamma = gamma
        self.raw_obs = self.envs.reset([seed * 1000 + i for i in range(num_envs)])
        self.return_carry = np.zeros(num_envs)
        self.policy = NeuralNetPolicy(obs_clip, seed)  # acts here; versions arrive through set_weights
        self.next_episode_id = episode_id_start  # of the next row (env fragment) produced

    def spaces(self) -> dict[str, Any]:
        return {"obs_dim": self.obs_dim, "action": self.action}

    @property
    def version(self) -> int:
        return self.policy.version

    def set_weights(self, weights: dict[str, Any]) -> int:
        """Install a published policy version: actor arrays plus the observation statistics to normalize with."""
        return self.policy.set_weights(weights)

    def sample(self) -> tuple[dict[str, Any], Trajectories]:
        """Step every env ``fragment_length`` times; return (small metadata, the fragment as a trajectory record:
        one row per env, see rlfabric.trajectory)."""
        if self.version < 0:
            raise RuntimeError("EnvRunner.sample called before set_weights")
        start = time.perf_counter()
        T, N, D = self.fragment_length, self.envs.num_envs, self.obs_dim
        raw_obs = np.empty((T, N, D), np.float32)  # for the observation statistics
        obs = np.empty((T, N, D), np.float32)  # what the policy saw (normalized when normalizing)
        act_shape = (T, N) if self.action.kind == "discrete" else (T, N, self.action.n)
        actions = np.empty(act_shape, np.int64 if self.action.kind == "discrete" else np.float32)
        logp = np.empty((T, N), np.float32)
        rewards = np.empty((T, N), np.float32)
        terminated = np.empty((T, N), bool)
        truncated = np.empty((T, N), bool)
        components = np.empty((len(self.components), T, N), np.float32)  # [K, T, N]: each component's values
        trunc_index, trunc_raw_obs = [], []
        ep_returns: list[float] = []
        ep_lengths: list[int] = []
        ep_components: list[np.ndarray] = []
        current = self.raw_obs
        for t in range(T):
            raw_obs[t] = current
            acted = self.policy.act(current)
            obs[t], actions[t], logp[t] = acted.info["inputs"], acted.actions, acted.logprobs
            step = self.envs.step(actions[t])
            rewards[t], terminated[t], truncated[t] = step.rewards, step.terminated, step.truncated
            if step.components is not None:
                components[:, t] = step.components
                ep_components += step.episode_components
            for i, final in step.final_obs.items():
                if step.truncated[i] and not step.terminated[i]:
                    trunc_index.append((t, i))
                    trunc_raw_obs.append(final)
            ep_returns += step.episode_returns
            ep_lengths += step.episode_lengths
            current = step.obs
        self.raw_obs = current
        named = dict(zip(self.components, components, strict=True))
        dones = np.logical_or(terminated, truncated)
        # The return statistics (reward scaling) are of the reward the learner trains on.
        trained = shaped_reward(rewards, named, self.reward_weights)
        returns, self.return_carry = discounted_returns(trained, dones, self.gamma, self.return_carry)
        trunc_raw = np.asarray(trunc_raw_obs, np.float32).reshape(-1, D)
        fragment = from_time_major(
            obs=obs,
            actions=actions,
            logprobs=logp,
            rewards=rewards,
            reward_components=named,
            terminated=terminated,
            truncated=truncated,
            version=self.version,
            bootstrap_obs=self.policy.inputs(current),
            truncation_index=np.asarray(trunc_index, np.int64).reshape(-1, 2),
            truncation_obs=self.policy.inputs(trunc_raw),
            first_episode_id=self.next_episode_id,
            # What this fragment adds to the global statistics; the learner merges them.
            extras={
                "obs_stats": RunningStats.of(raw_obs.reshape(T * N, D)).to_dict(),
                "return_stats": RunningStats.of(returns.reshape(-1, 1)).to_dict(),
            },
        )
        self.next_episode_id += N
        meta = {
            "version": self.version,
            "env_steps": T * N,
            "episode_returns": ep_returns,
            "episode_lengths": ep_lengths,
            # per component, its sum over each episode that ended here (in the order of episode_returns)
            "episode_components": {k: [float(e[j]) for e in ep_components] for j, k in enumerate(self.components)},
            "sample_time_s": time.perf_counter() - start,
        }
        return meta, fragment

    def evaluate(self, episodes: int, seed: int) -> list[float]:
        """Returns of ``episodes`` episodes with deterministic actions, on a fresh env (training envs untouched)."""
        if self.version < 0:
            raise RuntimeError("EnvRunner.evaluate called before set_weights")
        env = EnvVector([registry.make_env(self.env_id, self.env_kwargs)], name=self.env_id)
        obs = env.reset([seed])
        returns: list[float] = []
        while len(returns) < episodes:
            step = env.step(self.policy.act(obs, greedy=True).actions)
            returns += step.episode_returns
            obs = step.obs
        env.close()
        return returns


class MujocoWarning(UserWarning):
    """A warning of MuJoCo's C library (e.g. a deprecated attribute in a model file), as a Python warning."""


def show_mujoco_warnings_once() -> None:
    """Route MuJoCo's warnings through Python's ``warnings``, each distinct one shown once in this process.

    MuJoCo's C library prints its warnings itself (and appends them to MUJOCO_LOG.TXT in the working directory),
    so Python's warning filters never see them: a model file's deprecation ("compiler attribute 'settotalmass' is
    deprecated") came once per env built, in every runner. Here they become ``MujocoWarning``s under a "once"
    filter: a runner shows each distinct text once, however many envs it builds. Nothing happens where MuJoCo is
    not installed."""
    import importlib.util

    if importlib.util.find_spec("mujoco") is None:
        return
    try:
        import mujoco
    except Exception:  # a broken install: the env that needs it will say so
        return
    warnings.filterwarnings("once", category=MujocoWarning)

    def warn(text: str) -> None:
        try:
            warnings.warn(text.strip(), MujocoWarning, stacklevel=2)
        except Exception:  # warnings made errors (-W error): an exception must not cross MuJoCo's C code
            print(f"MujocoWarning: {text.strip()}", file=sys.stderr)

    mujoco.set_mju_user_warning(warn)


class RunnerProcess:
    """What every runner actor adds to its core: one OpenMP thread (a runner's numpy work is small; the learner
    wants the cores), MuJoCo's warnings once each (``show_mujoco_warnings_once``), and where it runs (fault tests
    kill it by pid; placement reads its node)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        show_mujoco_warnings_once()
        super().__init__(*args, **kwargs)

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


@ray.remote
class EnvRunner(RunnerProcess, EnvRunnerCore):
    """The Ray actor. ``sample`` returns two objects: metadata (small, read by the driver) and the fragment."""

    @ray.method(num_returns=2)
    def sample(self) -> tuple[dict[str, Any], Trajectories]:
        return super().sample()
