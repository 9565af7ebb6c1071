"""The torch engine's fallback decoder: static batches of any causal LM through the model's own forward and its own
cache. Correct for any causal LM; slower than ``rlfabric.engines.fast_decoder``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from rlfabric.engines.requests import EngineRequest
from rlfabric.engines.sampling import sample_tokens


class HFDecoder:
    """Any causal LM: left-padded static batches through ``model.forward`` with the model's own KV cache.

    A batch is admitted only when the previous one has finished; finished rows are dropped from the cache each
    step (``batch_select_indices``) so the batch still shrinks. Session keys are ignored: every prompt is
    prefilled whole.
    """

    def __init__(self, model: nn.Module, max_batch_size: int, matmul_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        weights_dtype = next(model.parameters()).dtype
        # Autocast gives any model the fast path's "matmuls in matmul_dtype" (it casts the weights per call).
        self.autocast = matmul_dtype is not None and matmul_dtype != weights_dtype
        self.matmul_dtype = matmul_dtype
        accepted = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache; logits_to_keep spares the lm_head on prompt positions.
        self.cache_arg = "cache" if "cache" in accepted else "past_key_values"
        self.extra_args = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
        self.prefill_tokens = 0
        self.reused_tokens = 0  # always: this decoder keeps no sessions
        self.reset()

    @property
    def running(self) -> list[EngineRequest]:
        return self.rows

    def free_slots(self) -> int:
        return 0 if self.rows else self.max_batch_size

    def reset(self) -> None:
        self.rows: list[EngineRequest] = []
        self.cache: Any = None
        self.mask = self.positions = self.pending = None

    def close(self) -> None:
        self.reset()

    def step(self, admitted: list[EngineRequest], generator: torch.Generator) -> list[EngineRequest]:
        logits = self._prefill(admitted) if admitted else self._decode()
        tokens, logprobs = sample_tokens(logits, [r.params for r in self.rows], generator)
        keep, done = [], []
        for row, (request, token, logprob) in enumerate(zip(self.rows, tokens, logprobs, strict=True)):
            (done if request.append(token, logprob) else keep).append(row)
        finished = [self.rows[row] for row in done]
        self.pending = torch.tensor(tokens, device=self.device)[:, None]
        if not keep:
            self.reset()
        elif done:
            index = torch.tensor(keep, device=self.device)
            self.cache.batch_select_indices(index)
            self.rows = [self.rows[row] for row in keep]
            self.mask, self.positions, self.pending = self.mask[index], self.positions[index], self.pending[index]
        return finished

    def refresh_weights(self) -> None:
        """Nothing to do: the model's own forward reads its parameters."""

    def forget_sessions(self) -> None:
        """Nothing to do: no sessions are kept."""

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=self.matmul_dtype, enabled=self.autocast):
            return self._model_forward(ids)

    def _model_forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=self.positions,
            use_cache=True,
            **self.extra_args,
            **{self.cache_arg: self.cache},
        )
        self.cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        return out.logits[:, -1]

    def _prefill(self, admitted: list[EngineRequest]) -> torch.Tensor:
        width = max(len(r.prompt) for r in admitted)
        ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in admitted], device=self.device)
        self.mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in admitted])
        self.mask = self.mask.to(self.device)
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)  # real tokens count from 0 despite the padding
        self.rows, self.cache = list(admitted), None
        self.prefill_tokens += sum(len(r.prompt) for r in admitted)
        return self._forward(ids)

    def _decode(self) -> torch.Tensor:
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.positions = self.positions[:, -1:] + 1
        return self._forward(self.pending)
