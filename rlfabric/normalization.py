"""Running mean/variance statistics that merge exactly across runners (Chan et al.'s parallel algorithm).

Runners accumulate statistics of what they saw during a fragment; the learner merges them into the global
statistics, which travel back to the runners with the next policy version.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RunningStats:
    """Count, mean and sum of squared deviations (M2) of a stream of vectors."""

    count: float
    mean: np.ndarray
    m2: np.ndarray

    @classmethod
    def empty(cls, shape: tuple[int, ...]) -> RunningStats:
        return cls(0.0, np.zeros(shape, np.float64), np.zeros(shape, np.float64))

    @classmethod
    def of(cls, batch: np.ndarray) -> RunningStats:
        """Statistics of ``batch`` (first axis = samples)."""
        batch = np.asarray(batch, np.float64)
        if batch.shape[0] == 0:
            return cls.empty(batch.shape[1:])
        mean = batch.mean(axis=0)
        return cls(float(batch.shape[0]), mean, ((batch - mean) ** 2).sum(axis=0))

    @property
    def var(self) -> np.ndarray:
        """Population variance; 1 where nothing has been seen yet (so normalizing is a no-op)."""
        if self.count == 0:
            return np.ones_like(self.m2)
        return self.m2 / self.count

    def merge(self, other: RunningStats) -> RunningStats:
        """Exact statistics of the union: n = na + nb, mean = ma + d nb/n, M2 = M2a + M2b + d^2 na nb / n."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        n = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * other.count / n
        m2 = self.m2 + other.m2 + delta**2 * self.count * other.count / n
        return RunningStats(n, mean, m2)

    def to_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean.copy(), "m2": self.m2.copy()}

    @classmethod
    def from_dict(cls, d: dict) -> RunningStats:
        return cls(float(d["count"]), np.asarray(d["mean"], np.float64), np.asarray(d["m2"], np.float64))


def normalize(x: np.ndarray, stats: RunningStats, clip: float, eps: float = 1e-8) -> np.ndarray:
    """(x - mean) / sqrt(var + eps), clipped to [-clip, clip], as float32."""
    return Normalizer(stats, clip, eps)(x)


class Normalizer:
    """``normalize`` with the statistics frozen: the per-step cost is one subtract, multiply and clip."""

    def __init__(self, stats: RunningStats, clip: float, eps: float = 1e-8) -> None:
        self.mean = stats.mean
        self.inv_std = 1.0 / np.sqrt(stats.var + eps)
        self.clip = clip

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out = (x - self.mean) * self.inv_std  # in float64: a small spread on a large offset keeps its digits
        return np.clip(out, -self.clip, self.clip, out=out).astype(np.float32)


def scale_rewards(rewards: np.ndarray, return_stats: RunningStats, clip: float, eps: float = 1e-8) -> np.ndarray:
    """Rewards divided by the std of the discounted return (no mean shift, as in baselines' VecNormalize)."""
    return np.clip(rewards / np.sqrt(return_stats.var + eps), -clip, clip).astype(np.float32)


def discounted_returns(rewards: np.ndarray, dones: np.ndarray, gamma: float, start: np.ndarray) -> tuple:
    """Running discounted returns R_t = gamma * R_{t-1} * (1 - done_{t-1}) + r_t over time-major [T, N] arrays.

    ``start`` is the carried R from the previous fragment (already reset where the episode ended).
    Returns (R for every step [T, N], the carry for the next fragment [N]).
    """
    out = np.empty_like(rewards, dtype=np.float64)
    running = start.astype(np.float64)
    for t in range(rewards.shape[0]):
        running = running * gamma + rewards[t]
        out[t] = running
        running = running * (1.0 - dones[t])
    return out, running
