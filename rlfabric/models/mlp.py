"""MLP actor-critic: a torch module for the learner and a numpy mirror of its actor for the runners.

Runners act on a handful of observations at a time, where torch's per-op overhead dominates; the numpy mirror
does the same math in a few microseconds and is tested equal to the torch module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
from torch import nn


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


_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def gaussian_logp_entropy(
    mean: torch.Tensor, log_std: torch.Tensor, actions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Diagonal Gaussian, summed over action dims (the formulas torch.distributions.Normal uses, without
    building a distribution object per minibatch):
    log p(a) = sum(-(a - mu)^2 / (2 sigma^2) - log sigma - log(2 pi) / 2);  H = sum(1/2 + log(2 pi) / 2 + log sigma).
    """
    z = (actions - mean) * torch.exp(-log_std)
    logp = (-0.5 * z.pow(2) - log_std - _HALF_LOG_2PI).sum(-1)
    entropy = (0.5 + _HALF_LOG_2PI + log_std).sum(-1).expand(mean.shape[0])
    return logp, entropy


# A masked logit: exp() of it is exactly 0 in float32, and 0 * it stays finite in the entropy (an -inf would not).
MASKED_LOGIT = -1e9


def masked_logits(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """logits where ``mask`` is True, MASKED_LOGIT where it is False: a masked action gets probability exactly 0."""
    return logits if mask is None else torch.where(mask, logits, torch.full_like(logits, MASKED_LOGIT))


def categorical_logp_entropy(logits: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits)[a] and the entropy -sum(p log p) of each row."""
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy


_NP_ACTIVATIONS = {"tanh": np.tanh, "relu": lambda x: np.maximum(x, 0.0)}


def _mlp(in_dim: int, hidden: list[int], out_dim: int, activation: str, out_gain: float) -> nn.Sequential:
    """Orthogonal init (sqrt(2) hidden, ``out_gain`` last), zero biases: the usual PPO recipe."""
    layers: list[nn.Module] = []
    dims = [in_dim, *hidden]
    for a, b in zip(dims[:-1], dims[1:], strict=True):
        linear = nn.Linear(a, b)
        nn.init.orthogonal_(linear.weight, math.sqrt(2))
        nn.init.zeros_(linear.bias)
        layers += [linear, _ACTIVATIONS[activation]()]
    last = nn.Linear(dims[-1], out_dim)
    nn.init.orthogonal_(last.weight, out_gain)
    nn.init.zeros_(last.bias)
    layers.append(last)
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs; a categorical head or a Gaussian with state-independent log std.

    ``critic_dim``: the critic's input size when it sees something other than the observation (a centralized
    critic on the global state, MAPPO); None: the observation.
    """

    def __init__(
        self,
        obs_dim: int,
        action: ActionSpec,
        hidden_sizes: list[int],
        activation: str = "tanh",
        init_log_std: float = 0.0,
        critic_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.action = action
        self.activation = activation
        self.actor = _mlp(obs_dim, hidden_sizes, action.n, activation, out_gain=0.01)
        self.critic = _mlp(critic_dim or obs_dim, hidden_sizes, 1, activation, out_gain=1.0)
        if action.kind == "continuous":
            self.log_std = nn.Parameter(torch.full((action.n,), float(init_log_std)))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def evaluate(
        self,
        obs: torch.Tensor,
        actions: torch.Tensor,
        mask: torch.Tensor | None = None,
        critic_obs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """(log pi(a|s), entropy, V) for a batch; Gaussian terms are summed over action dims. ``mask`` (bool
        [B, n]): the legal actions, the others get probability 0; V is of ``critic_obs`` when given, else of obs."""
        out = self.actor(obs)
        if self.action.kind == "discrete":
            logp, entropy = categorical_logp_entropy(masked_logits(out, mask), actions)
        else:
            logp, entropy = gaussian_logp_entropy(out, self.log_std, actions)
        return logp, entropy, self.value(obs if critic_obs is None else critic_obs)

    def actor_arrays(self) -> dict:
        """The actor's parameters as numpy arrays, the form runners receive."""
        linears = [m for m in self.actor if isinstance(m, nn.Linear)]
        arrays = {
            "weights": [m.weight.detach().cpu().numpy().T.copy() for m in linears],
            "biases": [m.bias.detach().cpu().numpy().copy() for m in linears],
            "activation": self.activation,
            "action": self.action,
        }
        if self.action.kind == "continuous":
            arrays["log_std"] = self.log_std.detach().cpu().numpy().copy()
        return arrays


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
