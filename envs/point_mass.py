"""PointMass: a tiny continuous-control task (push a 2-D point mass to a goal).

Cheap enough for tests of the Gaussian-policy path, and an example of shipping an env through the
``rlfabric.envs`` entry-point group (see pyproject.toml): ``rlfabric train env.id=rlfabric/PointMass-v0``.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np


class PointMassEnv(gym.Env):
    """obs = (position, velocity, goal); action = force in [-1, 1]^2; reward = -distance to the goal.

    Terminates when the point is within ``goal_radius`` of the goal (bonus +10); truncates after ``max_steps``.
    """

    metadata = {"render_modes": []}

    def __init__(self, max_steps: int = 100, goal_radius: float = 0.1, dt: float = 0.1) -> None:
        self.max_steps, self.goal_radius, self.dt = max_steps, goal_radius, dt
        # position in [-2, 2]; |velocity| <= 1 since v' = 0.9 v + 0.1 f with |f| <= 1; goal in [-1, 1].
        bound = np.array([2, 2, 1, 1, 1, 1], dtype=np.float32)
        self.observation_space = gym.spaces.Box(-bound, bound, dtype=np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.pos = np.zeros(2)
        self.vel = np.zeros(2)
        self.goal = np.zeros(2)
        self.steps = 0

    def _obs(self) -> np.ndarray:
        return np.concatenate([self.pos, self.vel, self.goal]).astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.pos = self.np_random.uniform(-1, 1, 2)
        self.goal = self.np_random.uniform(-1, 1, 2)
        self.vel = np.zeros(2)
        self.steps = 0
        return self._obs(), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        force = np.clip(np.asarray(action, dtype=np.float64), -1.0, 1.0)
        self.vel = 0.9 * self.vel + self.dt * force
        self.pos = np.clip(self.pos + self.dt * self.vel, -2.0, 2.0)
        self.steps += 1
        distance = float(np.linalg.norm(self.pos - self.goal))
        terminated = distance < self.goal_radius
        reward = -distance + (10.0 if terminated else 0.0)
        truncated = not terminated and self.steps >= self.max_steps
        return self._obs(), reward, terminated, truncated, {"distance": distance}
