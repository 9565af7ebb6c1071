"""MLP actor-critic: the torch module the learner trains. Its actor's numpy mirror, which the runners act with,
lives in ``rlfabric.models.numpy_policy`` (no torch there)."""

from __future__ import annotations

import math

import torch
from torch import nn

from rlfabric.models.numpy_policy import MASKED_LOGIT, ActionSpec, NumpyPolicy, obs_dim_of

__all__ = ["MASKED_LOGIT", "ActionSpec", "ActorCritic", "NumpyPolicy", "obs_dim_of"]


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


def masked_logits(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """logits where ``mask`` is True, MASKED_LOGIT where it is False: a masked action gets probability exactly 0."""
    return logits if mask is None else torch.where(mask, logits, torch.full_like(logits, MASKED_LOGIT))


def categorical_logp_entropy(logits: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits)[a] and the entropy -sum(p log p) of each row."""
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy


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
