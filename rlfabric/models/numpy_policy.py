"""The actor's forward pass and sampling in numpy, for env runners: no torch in their processes.

Runners act on a handful of observations at a time, where torch's per-op overhead dominates; this mirror of
``rlfabric.models.mlp.ActorCritic``'s actor does the same math in a few microseconds and is tested equal to it.
Keeping torch out of this module keeps it out of every runner: a runner's imports take 0.6 s against 2.2 s with
torch, and it holds about 180 MB less.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import gymnasium as gym
import numpy as np

# A masked logit: exp() of it is exactly 0 in float32, and 0 * it stays finite in the entropy (an -inf would not).
MASKED_LOGIT = -1e9
_NP_ACTIVATIONS = {"tanh": np.tanh, "relu": lambda x: np.maximum(x, 0.0)}


@dataclass(frozen=True)
class ActionSpec:
    """What the policy head outputs: ``n`` categories (discrete) or an ``n``-dim box (continuous)."""

    kind: Literal["discrete", "continuous"]
    n: int
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()

    @classmethod
    def from_space(cls, space: gym.Space) -> ActionSpec:
        if isinstance(space, gym.spaces.Discrete):
            return cls("discrete", int(space.n))
        if isinstance(space, gym.spaces.Box) and len(space.shape) == 1:
            return cls("continuous", int(space.shape[0]), tuple(map(float, space.low)), tuple(map(float, space.high)))
        raise ValueError(
            f"action space {space} is not supported: use Discrete or a 1-d Box "
            "(flatten others with a gymnasium wrapper in the env factory)"
        )


def obs_dim_of(space: gym.Space) -> int:
    if isinstance(space, gym.spaces.Box):
        return int(np.prod(space.shape))
    raise ValueError(
        f"observation space {space} is not supported by the MLP model: use a Box "
        "(wrap the env with gymnasium.wrappers.FlattenObservation in its factory)"
    )


def check_ppo_spaces(observation_space: gym.Space, action_space: gym.Space) -> None:
    """ValueError naming the space PPO's MLP policy cannot use (``obs_dim_of``, ``ActionSpec.from_space``)."""
    obs_dim_of(observation_space)
    ActionSpec.from_space(action_space)


class NumpyPolicy:
    """The actor's forward pass and sampling in numpy, from ``ActorCritic.actor_arrays()``."""

    def __init__(self, arrays: dict) -> None:
        self.weights = [w.astype(np.float32) for w in arrays["weights"]]
        self.biases = [b.astype(np.float32) for b in arrays["biases"]]
        self.act_fn = _NP_ACTIVATIONS[arrays["activation"]]
        self.action: ActionSpec = arrays["action"]
        if self.action.kind == "continuous":
            log_std = arrays["log_std"].astype(np.float64)
            self.std = np.exp(log_std).astype(np.float32)
            self.logp_offset = float(-log_std.sum() - 0.5 * math.log(2 * math.pi) * len(log_std))

    def forward(self, obs: np.ndarray) -> np.ndarray:
        h = obs
        for w, b in zip(self.weights[:-1], self.biases[:-1], strict=True):
            h = self.act_fn(h @ w + b)
        return h @ self.weights[-1] + self.biases[-1]

    def noise(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        """Exploration noise for ``shape`` observations, drawn in one call: Gumbel (discrete) or N(0, 1)."""
        n = self.action.n
        if self.action.kind == "discrete":
            return rng.gumbel(size=(*shape, n)).astype(np.float32)
        return rng.standard_normal((*shape, n), dtype=np.float32)

    def act_with_noise(
        self, obs: np.ndarray, noise: np.ndarray, mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Actions and their log-probabilities for a batch, given pre-drawn noise (zeros: the greedy action).

        Discrete: a = argmax(log_softmax(logits) + gumbel) (the Gumbel-max trick samples the softmax); with a
        ``mask`` (bool [B, n], the legal actions), masked logits are MASKED_LOGIT first, so they are never chosen.
        Gaussian: a = mean + std * eps, and log pi(a) = sum(-eps^2 / 2 - log std - log(2 pi) / 2).
        """
        out = self.forward(obs)
        if self.action.kind == "discrete":
            if mask is not None:
                out = np.where(mask, out, np.float32(MASKED_LOGIT))
            logits = out - out.max(axis=-1, keepdims=True)
            log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
            actions = (log_probs + noise).argmax(axis=-1)
            logp = np.take_along_axis(log_probs, actions[:, None], axis=-1)[:, 0]
            return actions.astype(np.int64), logp.astype(np.float32)
        actions = out + self.std * noise
        logp = (-0.5 * noise**2).sum(axis=-1) + self.logp_offset
        return actions.astype(np.float32), logp.astype(np.float32)

    def act(
        self, obs: np.ndarray, rng: np.random.Generator, deterministic: bool = False, mask: np.ndarray | None = None
    ) -> tuple:
        """Sample actions for a batch of observations (only legal ones under ``mask``); returns (actions,
        log-probabilities)."""
        noise = np.zeros((len(obs), self.action.n), np.float32) if deterministic else self.noise(rng, (len(obs),))
        return self.act_with_noise(obs, noise, mask)
