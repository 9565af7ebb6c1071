"""A neural-net policy acting inside the worker: the learner's actor as numpy arrays, plus the observation
statistics of the same version (at a few observations per step, numpy is several times faster than torch)."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlfabric.models.numpy_policy import NumpyPolicy
from rlfabric.normalization import Normalizer, RunningStats
from rlfabric.policies.base import PolicyOutput


class NeuralNetPolicy:
    """The local policy of PPO's env runners (``LocalPolicy``).

    ``set_weights`` installs a published version: ``{"actor": ActorCritic.actor_arrays(), "version": int,
    "obs_stats": RunningStats.to_dict() or None}``. ``act`` takes raw observations ``[N, D]``, normalizes them with
    that version's statistics (clipped to +-``obs_clip``) and samples; ``info["inputs"]`` is what the net saw,
    which is what the learner must train on.
    """

    def __init__(self, obs_clip: float, seed: int) -> None:
        self.obs_clip = obs_clip
        self.rng = np.random.default_rng(seed)
        self.net: NumpyPolicy | None = None
        self.normalizer: Normalizer | None = None  # None: the net sees raw observations
        self.version = -1

    def set_weights(self, weights: dict[str, Any]) -> int:
        self.net = NumpyPolicy(weights["actor"])
        self.version = int(weights["version"])
        stats = weights["obs_stats"]
        self.normalizer = None if stats is None else Normalizer(RunningStats.from_dict(stats), self.obs_clip)
        return self.version

    def inputs(self, raw: np.ndarray) -> np.ndarray:
        """What the net sees for raw observations ``raw`` (float32): normalized with this version's statistics (in
        float64 first, so a small spread on a large offset keeps its digits), or as is."""
        return np.asarray(raw, np.float32) if self.normalizer is None else self.normalizer(raw)

    def act(self, observations: np.ndarray, greedy: bool = False, mask: np.ndarray | None = None) -> PolicyOutput:
        """Sampled actions (the mean or the most likely one when ``greedy``) and their log-probabilities; with a
        ``mask`` (bool [N, n]), only legal actions."""
        if self.net is None:
            raise RuntimeError("NeuralNetPolicy.act called before set_weights: no policy version installed yet")
        seen = self.inputs(np.asarray(observations))
        actions, logp = self.net.act(seen, self.rng, deterministic=greedy, mask=mask)
        return PolicyOutput(actions, logp, np.full(len(seen), self.version, np.int64), {"inputs": seen})
