"""The vLLM generation engine: the ``rlfabric.engines.base`` contract on top of vLLM's async engine (V1).

Targets vLLM 0.11 and later (the V1 engine only; it was written against the 0.11-0.13 sources and checked against
newer ones). vLLM is imported inside the constructor and helpers, so this module imports on any machine; building
a ``VLLMEngine`` without vLLM raises an ``ImportError`` that says how to install it.

How the contract maps onto vLLM:

- ``generate`` submits every prompt at once to ``AsyncLLMEngine.generate`` (a ``TokensPrompt`` each, a unique
  request id each, ``logprobs=0`` so only the sampled token's logprob comes back, ``RequestOutputKind.FINAL_ONLY``
  so only the finished output crosses the process boundary, ``detokenize=False``) and gathers the results in prompt
  order. vLLM batches concurrent requests from every caller itself (continuous batching).
- Logprobs: the engine is built with ``logprobs_mode="processed_logprobs"``, so the logprob vLLM returns is
  log_softmax of the logits after temperature scaling (greedy requests use temperature 1) - the contract's
  log_softmax(logits / temperature). vLLM's default, ``"raw_logprobs"``, is log_softmax(logits) before temperature,
  which is right only at temperature 1. "Processed" also means after top-k / top-p truncation, so when a request
  truncates (top_p < 1 or top_k > 0) the logprob is that of the renormalised truncated distribution, not the
  contract's; the engine warns once when that happens. Keep top_p = 1 and top_k = 0 for on-policy RL.
  (vLLM picks its plain PyTorch top-k/top-p sampler in this mode instead of FlashInfer's; the cost is small.)
- ``load_weights`` closes a gate so new ``generate`` calls wait, waits for the calls in flight to finish (they
  keep the old version), then sends the tensors to every vLLM worker with ``collective_rpc`` into
  ``VLLMWorkerExtension.rlfabric_load_weights`` (installed through the ``worker_extension_cls`` engine argument),
  which calls the vLLM model's own ``load_weights`` with Hugging Face names, as verl, OpenRLHF and TRL do. Then it
  resets the prefix cache (its KV blocks were computed with the old weights), sets ``version`` and reopens the gate.
  Weights travel as raw bytes in buckets (``weight_bucket_bytes``) through vLLM's engine-core socket: no disk, no
  restart, no pickle, and the same path for one GPU or tensor parallelism. It copies through host memory, which is
  fine for models of a few billion parameters; NCCL or CUDA-IPC transfer is the faster path for larger ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import warnings
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import torch

from rlfabric.engines.base import Completion, SamplingParams
from rlfabric.models.weights import dtype_name, tensor_from_bytes

INSTALL_HINT = "the vllm backend needs the 'vllm' extra: pip install 'rlfabric[vllm]' on a machine with a CUDA GPU"

# Importable path of the worker extension; vLLM imports it in every worker process.
WORKER_EXTENSION = f"{__name__}.VLLMWorkerExtension"

# Engine arguments this backend sets itself: changing them would break the contract.
_FIXED_ENGINE_ARGS = ("logprobs_mode", "worker_extension_cls")

# One packed tensor: (Hugging Face name, torch dtype name, shape, raw bytes).
PackedTensor = tuple[str, str, list[int], bytes]


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return vllm


class VLLMEngine:
    """Generation on vLLM's async engine, with in-place weight updates tagged by policy version.

    Use one instance from one asyncio event loop (a Ray async actor's loop, say): vLLM's output handler is a task
    on the loop of the first ``generate`` call.

    ``engine_kwargs`` go to ``vllm.AsyncEngineArgs`` as they are (``enable_prefix_caching``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``kv_cache_dtype``, ...), except ``logprobs_mode`` and ``worker_extension_cls``,
    which this backend sets itself. ``weight_bucket_bytes`` bounds the bytes of one weight-update message.
    """

    def __init__(
        self,
        model_path: str,
        *,
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        weight_bucket_bytes: int = 256 * 2**20,
        **engine_kwargs: Any,
    ) -> None:
        vllm = _import_vllm()
        fixed = sorted(set(engine_kwargs) & set(_FIXED_ENGINE_ARGS))
        if fixed:
            raise ValueError(
                f"VLLMEngine sets {', '.join(fixed)} itself (the logprob contract and weight updates need them); "
                "leave them out of engine_kwargs"
            )
        if weight_bucket_bytes < 1:
            raise ValueError(f"VLLMEngine weight_bucket_bytes = {weight_bucket_bytes}: must be at least 1")
        engine_kwargs.setdefault("disable_log_stats", True)
        # A multi-turn episode's next prompt extends its last one: the cached blocks spare re-prefilling it.
        engine_kwargs.setdefault("enable_prefix_caching", True)
        args = vllm.AsyncEngineArgs(
            model=str(model_path),
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            **engine_kwargs,
        )
        self._engine: Any = vllm.AsyncLLMEngine.from_engine_args(args)
        model_config = getattr(self._engine, "model_config", None)
        # The dtype the weights live in on the GPU: updates are cast to it before they travel (half the bytes
        # when the learner holds fp32 and vLLM runs bf16).
        self.dtype: torch.dtype | None = getattr(model_config, "dtype", None)
        self.version = 0
        self.weight_bucket_bytes = weight_bucket_bytes
        self._gate = VersionGate()
        self._request_ids = itertools.count()
        self._id_prefix = f"rlfabric-{id(self):x}"
        self._warned_truncation = False

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, sessions: list[str | None] | None = None
    ) -> list[Completion]:
        """One completion per prompt, in order; every prompt goes to vLLM at once and vLLM batches them.
        ``sessions`` are not needed: vLLM's prefix caching finds a conversation's earlier turns by their tokens."""
        if not prompts:
            return []
        if self._engine is None:
            raise RuntimeError("VLLMEngine.generate after shutdown")
        if (params.top_p < 1 or params.top_k > 0) and not self._warned_truncation:
            self._warned_truncation = True
            warnings.warn(
                f"VLLMEngine: top_p = {params.top_p}, top_k = {params.top_k}: vLLM reports logprobs of the truncated "
                "distribution, not log_softmax(logits / temperature); the learner's recomputed logprobs will differ",
                stacklevel=2,
            )
        vllm_params = self._vllm_params(params)
        async with self._gate.generating():
            version = self.version
            requests = [asyncio.ensure_future(self._generate_one(prompt, vllm_params)) for prompt in prompts]
            try:
                outputs = await asyncio.gather(*requests)
            except BaseException:
                # Abort the rest (vLLM aborts a request whose generator is cancelled) and let them end before the
                # gate counts this call as finished, so no weight swap overlaps them.
                for request in requests:
                    request.cancel()
                await asyncio.gather(*requests, return_exceptions=True)
                raise
        return [_to_completion(prompt, output, version) for prompt, output in zip(prompts, outputs, strict=True)]

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Swap weights in place (Hugging Face names; a subset is fine) once the requests in flight finish."""
        if self._engine is None:
            raise RuntimeError("VLLMEngine.load_weights after shutdown")
        async with self._gate.swapping():
            for bucket in pack_weights(state_dict, dtype=self.dtype, bucket_bytes=self.weight_bucket_bytes):
                await self._engine.collective_rpc("rlfabric_load_weights", args=(bucket,))
            await self._reset_prefix_cache()
            self.version = version

    async def shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    async def _reset_prefix_cache(self) -> None:
        """Drop the KV blocks cached for shared prefixes: they were computed with the old weights."""
        # vLLM answers False (newer versions) while a request still holds blocks; none runs here, but the engine
        # core may free the last finished request's blocks a moment after its output arrived.
        for _ in range(100):
            if await self._engine.reset_prefix_cache() is not False:  # older versions answer None
                return
            await asyncio.sleep(0.01)
        raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")

    def _vllm_params(self, params: SamplingParams) -> Any:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VLLMSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 is "off" in vLLM too
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),  # the tokenizer's EOS always stops too (ignore_eos=False)
            stop=list(params.stop),
            include_stop_str_in_output=True,
            logprobs=0,  # the sampled token's logprob only
            # Stop strings are matched on vLLM's own detokenized text; vLLM loads tokenizers with AutoTokenizer,
            # which misreads the built-in character tokenizer (see rlfabric.models.hf.load_tokenizer).
            detokenize=bool(params.stop),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def _generate_one(self, prompt: list[int], vllm_params: Any) -> Any:
        from vllm.inputs import TokensPrompt

        request_id = f"{self._id_prefix}-{next(self._request_ids)}"
        final = None
        async for output in self._engine.generate(TokensPrompt(prompt_token_ids=list(prompt)), vllm_params, request_id):
            final = output
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        return final.outputs[0]


def _to_completion(prompt: list[int], output: Any, version: int) -> Completion:
    """A vLLM ``CompletionOutput`` as a contract ``Completion``."""
    if output.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with finish_reason={output.finish_reason!r}")
    token_ids = [int(token) for token in output.token_ids]
    if output.logprobs is None or len(output.logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no logprob for some generated tokens")
    # One {token_id: Logprob} per position; with logprobs=0 it holds only the sampled token.
    logprobs = [float(output.logprobs[i][token].logprob) for i, token in enumerate(token_ids)]
    return Completion(
        prompt_ids=list(prompt),
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=output.finish_reason,
        version=version,
    )


class VersionGate:
    """Many generation calls at once, or one weight swap alone.

    ``generating()`` waits while a swap is pending or running; ``swapping()`` stops new generation calls, waits
    for the running ones to finish, then runs alone. So every generation call sees exactly one set of weights.
    """

    def __init__(self) -> None:
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()
        self._open.set()
        self._swap_lock = asyncio.Lock()

    @property
    def running(self) -> int:
        return self._running

    @contextlib.asynccontextmanager
    async def generating(self) -> AsyncIterator[None]:
        while not self._open.is_set():
            await self._open.wait()
        self._running += 1  # no await between the check and this, so no swap starts in between
        self._idle.clear()
        try:
            yield
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def swapping(self) -> AsyncIterator[None]:
        async with self._swap_lock:
            self._open.clear()
            try:
                await self._idle.wait()
                yield
            finally:
                self._open.set()


def pack_weights(
    state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None, bucket_bytes: int = 256 * 2**20
) -> Iterator[list[PackedTensor]]:
    """Buckets of (name, dtype name, shape, raw bytes), each at most ``bucket_bytes`` unless one tensor is larger.

    Floating-point tensors are cast to ``dtype`` first when it is given. Plain bytes cross vLLM's engine-core
    socket (msgpack) and its worker broadcast (pickle) as they are, in every vLLM version.
    """
    bucket: list[PackedTensor] = []
    size = 0
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)  # on the tensor's own device, before the copy to host
        tensor = tensor.to("cpu").contiguous()
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        if bucket and size + len(data) > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, dtype_name(tensor.dtype), list(tensor.shape), data))
        size += len(data)
    if bucket:
        yield bucket


def unpack_weights(bucket: list[PackedTensor]) -> list[tuple[str, torch.Tensor]]:
    """The (name, CPU tensor) pairs of one ``pack_weights`` bucket. Tensors read the bytes in place: read-only."""
    return [(name, tensor_from_bytes(data, dtype, shape)) for name, dtype, shape, data in bucket]


class VLLMWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``), so ``collective_rpc`` can call these methods.

    Names carry an ``rlfabric_`` prefix: vLLM refuses an extension whose attributes clash with the worker's.
    """

    def rlfabric_load_weights(self, bucket: list[PackedTensor]) -> None:
        model = self.get_model()  # type: ignore[attr-defined]  # the vLLM worker's method
        device = next(model.parameters()).device
        weights = [(name, tensor.to(device)) for name, tensor in unpack_weights(bucket)]
        # The model's own loader maps Hugging Face names onto vLLM's fused, sharded parameters and copies in place,
        # so CUDA graphs captured over those parameters stay valid.
        model.load_weights(weights=weights)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
