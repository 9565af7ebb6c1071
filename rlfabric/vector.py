"""A synchronous vector of Gymnasium envs with same-step autoreset.

Gymnasium 1.x vector envs reset by default on the step *after* an episode ends: that step ignores the action
and returns the reset observation, a transition a learner must never train on. Here an env that ends is reset
inside the same ``step`` call: the caller gets the reset observation to act on next, plus the final observation
(for bootstrapping a truncated episode), so no transition ever spans two episodes and no step is wasted. It also
skips merging per-env info dicts, which costs about a quarter of MuJoCo's step time in ``SyncVectorEnv``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np


@dataclass
class VectorStep:
    obs: np.ndarray  # [N, D] observations to act on next (reset ones where an episode ended)
    rewards: np.ndarray  # [N]
    terminated: np.ndarray  # [N] bool
    truncated: np.ndarray  # [N] bool
    final_obs: dict[int, np.ndarray] = field(default_factory=dict)  # env index -> last obs of its episode
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)


class EnvVector:
    """N envs stepped in lockstep; flat float32 observations."""

    def __init__(self, envs: Sequence[gym.Env]) -> None:
        self.envs = list(envs)
        space = self.envs[0].action_space
        # The policy's actions are 0..n-1 (discrete) or unbounded (Gaussian); map them onto the env's space.
        self.clip_actions = isinstance(space, gym.spaces.Box)
        if self.clip_actions:
            self.low, self.high = space.low, space.high
        self.action_offset = int(space.start) if isinstance(space, gym.spaces.Discrete) else 0
        self.returns = np.zeros(len(self.envs))
        self.lengths = np.zeros(len(self.envs), dtype=np.int64)

    @property
    def num_envs(self) -> int:
        return len(self.envs)

    @staticmethod
    def _flat(obs: np.ndarray) -> np.ndarray:
        return np.asarray(obs, dtype=np.float32).reshape(-1)

    def reset(self, seeds: Sequence[int]) -> np.ndarray:
        self.returns[:] = 0.0
        self.lengths[:] = 0
        return np.stack([self._flat(env.reset(seed=int(s))[0]) for env, s in zip(self.envs, seeds, strict=True)])

    def step(self, actions: np.ndarray) -> VectorStep:
        if self.clip_actions:
            actions = np.clip(actions, self.low, self.high)
        elif self.action_offset:
            actions = actions + self.action_offset
        n = len(self.envs)
        obs = [None] * n
        rewards = np.empty(n, dtype=np.float32)
        terminated = np.zeros(n, dtype=bool)
        truncated = np.zeros(n, dtype=bool)
        out = VectorStep(obs=None, rewards=rewards, terminated=terminated, truncated=truncated)  # type: ignore[arg-type]
        for i, env in enumerate(self.envs):
            o, r, term, trunc, _ = env.step(actions[i])
            rewards[i] = r
            terminated[i], truncated[i] = term, trunc
            self.returns[i] += r
            self.lengths[i] += 1
            if term or trunc:
                out.final_obs[i] = self._flat(o)
                out.episode_returns.append(float(self.returns[i]))
                out.episode_lengths.append(int(self.lengths[i]))
                self.returns[i] = 0.0
                self.lengths[i] = 0
                o, _ = env.reset()
            obs[i] = self._flat(o)
        out.obs = np.stack(obs)
        return out

    def close(self) -> None:
        for env in self.envs:
            env.close()
