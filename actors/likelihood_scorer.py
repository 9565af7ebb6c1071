"""The likelihood scorer: the current policy's weights, synced each version like a generator, scoring targets.

A GRPO run starts one when a ``likelihood`` reward asks for ``weights: policy`` (``rlfabric.rewards.likelihood``).
It is a Ray named actor: the reward services find it by the name the driver gives the reward's kwargs
(``scorer``), so a replacement under the same name serves them at once. The driver's ``WeightPublisher`` hands it
every published version (object store or shared memory, as the generators get them); ``rlfabric.likelihood_scorers``
starts it and replaces it when it dies or misses its load deadline. Every score carries the policy version that
computed it. It runs one call at a time: a caller that stops waiting cancels its call (``get_or_cancel``).
"""

from __future__ import annotations

import os

import numpy as np
import ray
import torch

from rlfabric.allocator import retain_freed_memory
from rlfabric.models.hf import load_causal_lm, load_tokenizer
from rlfabric.models.shared_weights import SharedFlatWeights
from rlfabric.models.weights import as_state_dict
from rlfabric.rewards.likelihood import target_logprobs
from rlfabric.rewards.registry import Unscored


@ray.remote
class LikelihoodScorer:
    def __init__(self, model_dir: str, dtype: str = "float32", device: str = "cpu", num_threads: int = 0) -> None:
        """The run's first model (``model_dir``, policy version 0) until the first published weights arrive."""
        retain_freed_memory()
        if num_threads:
            torch.set_num_threads(num_threads)
        self.model = load_causal_lm(model_dir, dtype=dtype, device=device)
        self.model.requires_grad_(False)
        self.tokenizer = load_tokenizer(model_dir)
        self.policy_version = 0

    def update_weights(self, weights: list[ray.ObjectRef] | SharedFlatWeights, version: int) -> int:
        """Load published weights, given as the generators get them (see ``LLMLearner.publish``)."""
        published = weights if isinstance(weights, SharedFlatWeights) else ray.get(weights[0])
        self.model.load_state_dict(as_state_dict(published))
        if isinstance(published, SharedFlatWeights):
            published.check_intact()
        self.policy_version = int(version)
        return self.policy_version

    def score(
        self, contexts: list[str], targets: list[str], batch_size: int, max_length: int | None = None
    ) -> tuple[list[np.ndarray | Unscored], int]:
        """(each target's per-token log-probs given its context, or ``Unscored`` for a pair that cannot be scored;
        the policy version of the weights used): ``rlfabric.rewards.likelihood.target_logprobs``."""
        logprobs = target_logprobs(self.model, self.tokenizer, contexts, targets, batch_size, max_length)
        return logprobs, self.policy_version

    def version(self) -> int:
        return self.policy_version

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()
