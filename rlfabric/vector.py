"""A synchronous vector of Gymnasium envs with same-step autoreset.

Gymnasium 1.x vector envs reset by default on the step *after* an episode ends: that step ignores the action
and returns the reset observation, a transition a learner must never train on. Here an env that ends is reset
inside the same ``step`` call: the caller gets the reset observation to act on next, plus the final observation
(for bootstrapping a truncated episode), so no transition ever spans two episodes and no step is wasted. It also
skips merging per-env info dicts, which costs about a quarter of MuJoCo's step time in ``SyncVectorEnv``: ``info``
is read only for the reward components a run names (``components``), and then only those keys.

Every observation and reward is checked to be finite (one vectorized check per step of the vector): a NaN or an
infinity is the env's error, ``NonFiniteEnvOutput``, naming the env, the field and the step of its episode, since
one of them poisons the normalizer statistics, the advantages and from there every weight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np

from rlfabric.reward_shaping import missing_component


class NonFiniteEnvOutput(ValueError):
    """An env returned a NaN or infinite observation, reward or reward component."""


def non_finite_error(env: str, what: str, value: object, where: str) -> NonFiniteEnvOutput:
    """One line: the env, the field (``what``: an observation, a reward, an agent's reward), its first bad value
    and where in the episode (``where``)."""
    arr = np.atleast_1d(np.asarray(value, np.float64))
    bad = int(np.flatnonzero(~np.isfinite(arr))[0])
    shown = f"{arr[bad]} at index {bad}" if arr.size > 1 else f"{arr[bad]}"
    return NonFiniteEnvOutput(
        f"env {env!r} returned a non-finite {what} ({shown}) {where}; an env must return finite observations and "
        "rewards"
    )


def to_env_actions(space: gym.Space, actions: np.ndarray) -> np.ndarray:
    """The policy's actions (0..n-1 for a discrete space, unbounded Gaussian samples for a Box) as an env of
    ``space`` takes them: clipped into a Box's bounds, shifted by a Discrete's ``start``."""
    if isinstance(space, gym.spaces.Box):
        return np.clip(actions, space.low, space.high)
    if isinstance(space, gym.spaces.Discrete) and space.start:
        return actions + int(space.start)
    return actions


@dataclass
class VectorStep:
    obs: np.ndarray  # [N, D] observations to act on next (reset ones where an episode ended)
    rewards: np.ndarray  # [N]
    terminated: np.ndarray  # [N] bool
    truncated: np.ndarray  # [N] bool
    final_obs: dict[int, np.ndarray] = field(default_factory=dict)  # env index -> last obs of its episode
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    # [K, N] float32: the step's value of each of the vector's ``components`` (None when it reads none)
    components: np.ndarray | None = None
    # per episode that ended, in the order of ``episode_returns``: [K] sums of the components over the episode
    episode_components: list[np.ndarray] = field(default_factory=list)


class EnvVector:
    """N envs stepped in lockstep; flat float32 observations."""

    def __init__(self, envs: Sequence[gym.Env], name: str = "env", components: Sequence[str] = ()) -> None:
        """``name``: what errors call the env (its ``env.id``). ``components``: info keys read at every step as
        named reward components (each must be in every step's info); () reads no info at all."""
        self.envs = list(envs)
        self.name = name
        self.components = tuple(components)
        self.action_space = self.envs[0].action_space
        self.returns = np.zeros(len(self.envs))
        self.lengths = np.zeros(len(self.envs), dtype=np.int64)
        self.component_sums = np.zeros((len(self.envs), len(self.components)))
        self.obs_size = 0  # of a flat observation: known at the first reset

    @property
    def num_envs(self) -> int:
        return len(self.envs)

    @staticmethod
    def _flat(obs: np.ndarray) -> np.ndarray:
        return np.asarray(obs, dtype=np.float32).reshape(-1)

    def reset(self, seeds: Sequence[int]) -> np.ndarray:
        self.returns[:] = 0.0
        self.lengths[:] = 0
        self.component_sums[:] = 0.0
        obs = np.stack([self._flat(env.reset(seed=int(s))[0]) for env, s in zip(self.envs, seeds, strict=True)])
        self.obs_size = obs.shape[1]
        if not np.isfinite(obs).all():
            i = int(np.flatnonzero(~np.isfinite(obs).all(axis=1))[0])
            raise self._non_finite("observation", obs[i], i, "at reset")
        return obs

    def step(self, actions: np.ndarray) -> VectorStep:
        actions = to_env_actions(self.action_space, actions)
        n = len(self.envs)
        obs = np.empty((n, self.obs_size), dtype=np.float32)
        rewards = np.empty(n, dtype=np.float32)
        terminated = np.zeros(n, dtype=bool)
        truncated = np.zeros(n, dtype=bool)
        out = VectorStep(obs=obs, rewards=rewards, terminated=terminated, truncated=truncated)
        keys = self.components
        if keys:
            out.components = np.empty((len(keys), n), dtype=np.float32)
        for i, env in enumerate(self.envs):
            o, r, term, trunc, info = env.step(actions[i])
            rewards[i] = r
            terminated[i], truncated[i] = term, trunc
            self.returns[i] += r
            self.lengths[i] += 1
            if keys:
                self._read_components(info, out.components, i)
            if term or trunc:
                final = self._flat(o)
                if not np.isfinite(final).all():
                    raise self._non_finite("observation", final, i, f"at step {self.lengths[i]} of an episode")
                out.final_obs[i] = final
                out.episode_returns.append(float(self.returns[i]))
                out.episode_lengths.append(int(self.lengths[i]))
                self.returns[i] = 0.0
                self.lengths[i] = 0
                o, _ = env.reset()
            obs[i] = np.reshape(o, -1)  # cast to float32 on the way in
        # One cheap test for every value at once: a sum of squares is finite exactly when every term is, unless
        # it overflows (values past 1e19), which the exact check then clears.
        flat = obs.reshape(-1)
        if not math.isfinite(np.dot(flat, flat) + np.dot(rewards, rewards)):
            self._check_finite(out)
        if keys:
            self._sum_components(out)
        return out

    def _read_components(self, info: dict, into: np.ndarray, i: int) -> None:
        """Env ``i``'s value of each component this step into ``into[:, i]``."""
        for k, key in enumerate(self.components):
            try:
                into[k, i] = info[key]
            except KeyError:
                raise missing_component(self.name, key, info) from None
            except (TypeError, ValueError):
                raise ValueError(
                    f"env {self.name!r} gave {key}={info[key]!r} in its step info; a reward component is a number"
                ) from None

    def _sum_components(self, out: VectorStep) -> None:
        """Check the step's components, add them to each env's episode sums, and hand over the sums of the
        episodes that ended (in the order of ``episode_returns``)."""
        values = out.components
        assert values is not None
        flat = values.reshape(-1)
        bad = np.argwhere(~np.isfinite(values)) if not math.isfinite(np.dot(flat, flat)) else ()
        if len(bad):  # (not when the sum of squares only overflowed)
            k, i = int(bad[0][0]), int(bad[0][1])
            name = f"reward component {self.components[k]!r}"
            raise self._non_finite(name, values[k, i], i, f"at step {self._step_of(out, i)} of an episode")
        self.component_sums += values.T
        for i in out.final_obs:
            out.episode_components.append(self.component_sums[i].copy())
            self.component_sums[i] = 0.0

    def _check_finite(self, out: VectorStep) -> None:
        """Raise the error for the first env whose reward or next observation in ``out`` is not finite (the rare
        path: the step of its episode is found again here)."""
        for i in range(len(self.envs)):
            step = self._step_of(out, i)
            at_step = f"at step {step} of an episode"
            if not np.isfinite(out.rewards[i]):
                raise self._non_finite("reward", out.rewards[i], i, at_step)
            if not np.isfinite(out.obs[i]).all():
                where = f"at reset (after an episode of {step} steps)" if i in out.final_obs else at_step
                raise self._non_finite("observation", out.obs[i], i, where)

    def _step_of(self, out: VectorStep, i: int) -> int:
        """The step of its episode env ``i`` took in ``out`` (an episode that ended there: its length)."""
        ended = list(out.final_obs)  # in the order of episode_lengths
        return out.episode_lengths[ended.index(i)] if i in ended else int(self.lengths[i])

    def _non_finite(self, what: str, value: object, i: int, where: str) -> NonFiniteEnvOutput:
        return non_finite_error(self.name, what, value, f"{where} (env copy {i})")

    def close(self) -> None:
        for env in self.envs:
            env.close()
