"""The generator: an async Ray actor hosting one generation engine (torch or vLLM) and its tokenizer.

Many callers at once (training batches, evaluation) share the engine, which batches their requests together.
Completions come back with their text decoded here, next to the tokenizer, so the driver never touches tokens.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

import ray

from rlfabric.allocator import retain_freed_memory
from rlfabric.models.hf import load_tokenizer

if TYPE_CHECKING:
    from rlfabric.models.shared_weights import SharedFlatWeights

# torch and the engines are imported inside the methods: every process that unpickles a handle to a generator
# (rollout workers, reward services, the driver) imports this module, and only the generator's own needs torch.


def build_engine(backend: str, model_dir: str, options: dict[str, Any]) -> Any:
    """The engine named by ``generator.backend``; vLLM is imported only when asked for."""
    if backend == "torch":
        from rlfabric.engines.torch_engine import TorchEngine

        return TorchEngine.from_pretrained(model_dir, **options)
    if backend == "vllm":
        from rlfabric.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, **options)
    raise ValueError(f"generator.backend = {backend!r} is not valid: expected 'torch' or 'vllm'")


@ray.remote
class Generator:
    def __init__(self, backend: str, model_dir: str, options: dict[str, Any], num_threads: int | None = None) -> None:
        import torch

        retain_freed_memory()
        if num_threads:
            torch.set_num_threads(num_threads)
        self.tokenizer = load_tokenizer(model_dir)
        self.engine = build_engine(backend, model_dir, options)
        self._loaded = asyncio.Condition()  # notified after every weight load

    async def generate(
        self,
        prompts: list[list[int]],
        params: dict[str, Any],
        sessions: list[str | None] | None = None,
        after_version: int | None = None,
    ) -> list[dict[str, Any]]:
        """One completion per prompt: token ids, behaviour logprobs, finish reason, version and decoded text.
        ``sessions``: a conversation key (or None) per prompt, so the engine continues its stored turns.
        ``after_version``: first wait until the engine holds at least this policy version (a rollout sent while
        its weights were still being trained starts the moment they are loaded)."""
        from rlfabric.engines.base import SamplingParams

        if after_version is not None:
            async with self._loaded:
                await self._loaded.wait_for(lambda: self.engine.version >= after_version)
        completions = await self.engine.generate(prompts, SamplingParams(**params), sessions)
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        # a shallow dict per completion: dataclasses.asdict deep-copies every token list (about 2 ms for 64)
        return [{**vars(c), "text": text} for c, text in zip(completions, texts, strict=False)]

    async def update_weights(self, weights: list[ray.ObjectRef] | SharedFlatWeights, version: int) -> int:
        """Load published weights: ``[ObjectRef]`` of FlatWeights (or a plain state dict), or a SharedFlatWeights
        handle from a learner on this node (see ``LLMLearner.publish``)."""
        from rlfabric.models.shared_weights import SharedFlatWeights
        from rlfabric.models.weights import as_state_dict

        published = weights if isinstance(weights, SharedFlatWeights) else await weights[0]
        await self.engine.load_weights(as_state_dict(published), version)
        if isinstance(published, SharedFlatWeights):
            published.check_intact()
        async with self._loaded:
            self._loaded.notify_all()
        return version

    def stats(self) -> dict[str, int]:
        """The engine's counters (``TorchEngine.stats``: prefilled and session-reused prompt tokens); {} for vLLM."""
        stats = getattr(self.engine, "stats", None)
        return stats() if stats is not None else {}

    def attention(self) -> str | None:
        """Which attention the torch engine decodes with (see ``TorchEngine.attention``); None for vLLM."""
        return getattr(self.engine, "attention", None)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def version(self) -> int:
        return self.engine.version

    def pid(self) -> int:
        return os.getpid()

    async def shutdown(self) -> None:
        await self.engine.shutdown()
