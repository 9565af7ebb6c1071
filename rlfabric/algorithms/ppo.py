"""PPO's math, top to bottom: bootstrap values, GAE, clipped surrogate, clipped value loss.

Arrays are time-major: ``[T, N]`` for T steps of N parallel envs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def next_state_values(
    values: np.ndarray,
    last_values: np.ndarray,
    truncated_index: np.ndarray,
    truncated_values: np.ndarray,
) -> np.ndarray:
    """V(s_{t+1}) for every step.

    next[t] = values[t + 1] for t < T-1 and next[T-1] = last_values (the state after the fragment). Where an
    episode was truncated at (t, n), the next state is the episode's final observation, not the reset one
    that follows it, so next[t, n] = V(final_obs): truncation bootstraps, it does not end the return.
    """
    next_values = np.empty_like(values)
    next_values[:-1] = values[1:]
    next_values[-1] = last_values
    if len(truncated_index):
        next_values[truncated_index[:, 0], truncated_index[:, 1]] = truncated_values
    return next_values


def row_next_values(
    values: np.ndarray,
    lengths: np.ndarray,
    bootstrap_values: np.ndarray,
    truncation_index: np.ndarray,
    truncation_values: np.ndarray,
) -> np.ndarray:
    """V(s_{t+1}) for every position of rows of different lengths (``values`` [N, L], row i uses its first
    lengths[i] positions; a multi-agent fragment's rows are one agent's own steps each).

    next[i, t] = values[i, t + 1] for t < lengths[i] - 1;  next[i, lengths[i] - 1] = bootstrap_values[i] (the value
    of what the agent observed after its last step);  next[i, t] = 0 for t >= lengths[i] (padding).
    At a truncation (i, t) (rows of ``truncation_index``), next[i, t] = V(final observation), as in
    ``next_state_values``. Rows of full length L give exactly ``next_state_values`` transposed.
    """
    n, width = values.shape
    next_values = np.zeros_like(values)
    next_values[:, :-1] = values[:, 1:]
    rows = np.arange(n)
    last = lengths.astype(np.int64) - 1
    has = last >= 0
    next_values[rows[has], last[has]] = bootstrap_values[has]
    next_values[np.arange(width)[None, :] >= lengths[:, None]] = 0.0
    if len(truncation_index):
        next_values[truncation_index[:, 0], truncation_index[:, 1]] = truncation_values
    return next_values


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    next_values: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    gamma: float,
    lam: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalized advantage estimation (Schulman et al. 2016).

    delta_t = r_t + gamma * (1 - terminated_t) * V(s_{t+1}) - V(s_t)
    A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1},   done_t = terminated_t or truncated_t
    returns = A + V

    Termination zeroes the bootstrap; truncation keeps it (V(s_{t+1}) is the final observation's value) but
    still stops the recursion, since the next step belongs to a new episode.
    """
    not_terminated = 1.0 - terminated.astype(np.float64)
    not_done = 1.0 - np.logical_or(terminated, truncated).astype(np.float64)
    deltas = rewards + gamma * not_terminated * next_values - values
    advantages = np.zeros_like(values, dtype=np.float64)
    running = np.zeros(values.shape[1:], dtype=np.float64)
    for t in reversed(range(values.shape[0])):
        running = deltas[t] + gamma * lam * not_done[t] * running
        advantages[t] = running
    advantages = advantages.astype(np.float32)
    return advantages, (advantages + values).astype(np.float32)


@dataclass
class PolicyLossInfo:
    approx_kl: float
    clip_fraction: float


def clipped_surrogate_loss(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_coef: float,
) -> tuple[torch.Tensor, PolicyLossInfo]:
    """PPO-clip: mean over samples of max(-A r, -A clip(r, 1 - eps, 1 + eps)), r = exp(logp_new - logp_old).

    Also returns the approximate KL, mean((r - 1) - log r) (Schulman's k3 estimator), and the fraction of
    samples whose ratio was clipped.
    """
    log_ratio = new_logp - old_logp
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_coef, 1.0 + clip_coef)
    loss = torch.max(unclipped, clipped).mean()
    with torch.no_grad():
        approx_kl = ((ratio - 1.0) - log_ratio).mean().item()
        clip_fraction = ((ratio - 1.0).abs() > clip_coef).float().mean().item()
    return loss, PolicyLossInfo(approx_kl, clip_fraction)


def value_loss(
    new_values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    clip_coef: float | None,
) -> torch.Tensor:
    """0.5 * mean((V - R)^2); with ``clip_coef``, the pessimistic max against V clipped to old V +- clip_coef."""
    unclipped = (new_values - returns) ** 2
    if clip_coef is None:
        return 0.5 * unclipped.mean()
    clipped_values = old_values + torch.clamp(new_values - old_values, -clip_coef, clip_coef)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.max(unclipped, clipped).mean()


def normalize_advantages(advantages: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(A - mean A) / (std A + eps) over the minibatch; unchanged for a single sample."""
    if advantages.numel() < 2:
        return advantages
    return (advantages - advantages.mean()) / (advantages.std() + eps)


def explained_variance(values: np.ndarray, returns: np.ndarray) -> float:
    """1 - Var(R - V) / Var(R): 1 is a perfect critic, 0 no better than a constant, nan when Var(R) = 0."""
    var_returns = float(np.var(returns))
    return float("nan") if var_returns == 0 else 1.0 - float(np.var(returns - values)) / var_returns


def linear_lr(base_lr: float, update_index: int, total_updates: int) -> float:
    """Learning rate annealed linearly from base_lr at update 0 to base_lr / total_updates at the last one."""
    frac = 1.0 - update_index / max(total_updates, 1)
    return base_lr * max(frac, 1.0 / max(total_updates, 1))


def normalize_values(x: np.ndarray, mean: float, var: float, eps: float = 1e-5) -> np.ndarray:
    """Value normalization (MAPPO's ValueNorm): (x - mean) / sqrt(var + eps), with the running statistics of the
    returns. The critic learns normalized targets, so its output scale stays near 1 whatever the rewards' scale."""
    return ((x - mean) / np.sqrt(var + eps)).astype(np.float32)


def denormalize_values(y: np.ndarray, mean: float, var: float, eps: float = 1e-5) -> np.ndarray:
    """The inverse of ``normalize_values``: y * sqrt(var + eps) + mean, the critic's output in return units."""
    return (y * np.sqrt(var + eps) + mean).astype(np.float32)
