"""The reference model: a frozen copy of the starting weights, giving logprobs for the KL penalty.

Used when ``grpo.reference: actor`` (e.g. the reference on its own GPU, away from the learner's memory);
``grpo.reference: learner`` keeps the copy inside the learner instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray
import torch

from rlfabric import objectives
from rlfabric.allocator import retain_freed_memory
from rlfabric.models.hf import load_causal_lm
from rlfabric.models.llm_batch import grpo_batch
from rlfabric.models.prefix_packing import check_maskable, maskable
from rlfabric.models.sequences import batched_response_logprobs
from rlfabric.models.shared_weights import SharedFlatWeights
from rlfabric.models.weights import as_state_dict


@ray.remote
class Reference:
    def __init__(
        self,
        model_dir: str,
        temperature: float,
        micro_batch_size: int,
        dtype: str = "float32",
        device: str = "cpu",
        num_threads: int = 0,
        matmul_dtype: str | None = None,
        batch_spec: dict[str, Any] | None = None,
        pad_id: int = 0,
        sequence_packing: str = "auto",
        parts: bytes | None = None,
    ) -> None:
        """``parts``: what the driver's user code added to ``rlfabric.objectives`` (its advantage estimator: the
        batch is the learner's)."""
        retain_freed_memory()
        objectives.load_snapshot(parts)
        if num_threads:
            torch.set_num_threads(num_threads)
        self.model = load_causal_lm(model_dir, dtype=dtype, device=device)
        self.model.requires_grad_(False)
        if sequence_packing == "shared_prefix":
            check_maskable(self.model)
        # "auto" falls back to padded rows where the attention cannot take the shared-prefix mask.
        self.packing = (
            sequence_packing if maskable(self.model) else "padded"
        )  # the learner's: the same arithmetic as its forward
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.matmul_dtype = matmul_dtype  # the learner's, so the KL compares like with like
        self.device = torch.device(device)
        self.batch_spec = batch_spec or {}
        self.pad_id = pad_id

    def set_weights(self, weights: list[ray.ObjectRef] | SharedFlatWeights) -> None:
        """Become a frozen copy of published weights (after the SFT warm-up: the policy GRPO starts from), given as
        the generators get them (see ``LLMLearner.publish``)."""
        published = weights if isinstance(weights, SharedFlatWeights) else ray.get(weights[0])
        self.model.load_state_dict(as_state_dict(published))
        if isinstance(published, SharedFlatWeights):
            published.check_intact()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def logprobs_of(self, trajectory_refs: list[ray.ObjectRef], groups: list[int] | None) -> np.ndarray:
        """Response-token logprobs [N, R] of the chosen groups of trajectory records, packed as the learners pack
        them (``grpo_batch`` with the same options), row for row."""
        batch = grpo_batch(ray.get(trajectory_refs), groups, pad_id=self.pad_id, **self.batch_spec)
        return self.logprobs(batch)

    @torch.no_grad()
    def logprobs(self, batch: dict[str, Any]) -> np.ndarray:
        """Response-token logprobs [N, R] of a packed batch (see rlfabric.models.sequences)."""
        ids = torch.as_tensor(batch["input_ids"]).to(self.device)
        mask = torch.as_tensor(batch["attention_mask"]).to(self.device)
        return batched_response_logprobs(
            self.model,
            ids,
            mask,
            int(batch["prompt_len"]),
            self.temperature,
            self.micro_batch_size,
            self.matmul_dtype,
            self.packing,
        )
