"""The torch generation engine: continuous batching over a KV cache, on CPU or GPU.

One scheduler task owns the model. ``generate`` calls from any number of coroutines enqueue one request per prompt
(``rlfabric.engines.requests``) and await its future. Every scheduler step:

1. admits waiting requests into free batch slots and prefills them together (one padded forward),
2. decodes every running sequence by one token (one forward for the whole batch),
3. samples (``rlfabric.engines.sampling``), and retires finished sequences at once, so the batch shrinks as
   sequences end instead of computing padding for them.

Steps run on the process's one compute thread (``compute_thread``: one OpenMP team per process), so the event
loop stays free for new requests and weight updates while the model computes (torch releases the GIL inside its
kernels).

Two decoders implement the steps:

* ``FastDecoder`` (``rlfabric.engines.fast_decoder``, its layers' weights and ops in
  ``rlfabric.engines.fast_layers``; Llama, Qwen2 and Mistral families): the decoder forward written out by hand
  over a preallocated slot KV cache, reading the weights straight from the model's parameters (or from copies of
  the projections in ``matmul_dtype``). It skips the per-step plumbing of transformers' ``generate``.
* ``HFDecoder`` (``rlfabric.engines.hf_decoder``; anything else, or ``use_fast_path=False``): static batches
  through the model's own forward and its own cache. Correct for any causal LM; slower.

Weight updates follow the contract in ``rlfabric.engines.base``: a swap waits until the running sequences finish
(they keep the old version), admission pauses meanwhile (new requests wait for the swap), then the tensors are
copied in place by Hugging Face name.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from rlfabric.engines.base import Completion, SamplingParams
from rlfabric.engines.fast_decoder import FastDecoder, fast_path_unsupported_reason
from rlfabric.engines.hf_decoder import HFDecoder
from rlfabric.engines.requests import EngineRequest
from rlfabric.models.precision import resolve_matmul_dtype

T = TypeVar("T")

COMPUTE_THREAD_NAME = "rlfabric-torch-compute"
_compute: ThreadPoolExecutor | None = None
_compute_lock = threading.Lock()


def compute_thread() -> ThreadPoolExecutor:
    """The one thread of this process that runs engine compute (model loading, steps, weight copies).

    OpenMP keeps a team of worker threads per thread that starts parallel work. Once two teams exist there are
    more OpenMP threads than cores, and libgomp stops spin-waiting between kernels: every small kernel then pays a
    thread wake-up, which costs decoding 1.3x on two cores. Loading and stepping on this one thread keeps a
    single team. It takes the torch thread count in force when it is first needed (a new thread would otherwise
    get OpenMP's process default, OMP_NUM_THREADS, which Ray sets to an actor's CPU count).
    """
    global _compute
    with _compute_lock:
        if _compute is None:
            _compute = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix=COMPUTE_THREAD_NAME,
                initializer=torch.set_num_threads,
                initargs=(torch.get_num_threads(),),
            )
        return _compute


def on_compute_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` run on the compute thread (directly when already on it), its result returned."""
    if threading.current_thread().name.startswith(COMPUTE_THREAD_NAME):
        return fn(*args, **kwargs)
    return compute_thread().submit(fn, *args, **kwargs).result()


@dataclass(eq=False)
class _Swap:
    state_dict: dict[str, torch.Tensor]
    version: int
    future: asyncio.Future


@dataclass
class _StepResult:
    """What one compute-thread step hands to the event loop, which alone resolves futures."""

    finished: list[EngineRequest] = field(default_factory=list)
    swapped: list[_Swap] = field(default_factory=list)
    error: Exception | None = None
    failed: list[EngineRequest | _Swap] = field(default_factory=list)  # the work ``error`` broke


class TorchEngine:
    """``rlfabric.engines.base.Engine`` on torch: continuous batching on CPU or GPU.

    ``tokenizer_or_eos_ids`` sets the stop tokens every request has (``SamplingParams.stop_token_ids`` add more):
    a tokenizer (its EOS plus the model's generation-config EOS ids), an id or ids (exactly those; ``[]`` for
    none), or None (the model's generation-config EOS ids). ``max_seq_len`` bounds prompt + new tokens per request
    (default: the model's ``max_position_embeddings``). The fast path's KV cache grows with use up to
    ``max_batch_size`` x ``max_seq_len`` tokens. ``device`` None leaves the model where it is.

    ``matmul_dtype`` (``"bfloat16"``, a torch dtype, or None for the model's own) sets the dtype of the decoder
    layers' projections: the fast path keeps copies of them in that dtype (re-made at every weight load) while
    norms, RoPE, attention, the KV cache, the LM head and the returned logprobs stay in the model's dtype; the
    fallback runs the model under autocast. bfloat16 roughly halves decode time on CPUs with bf16 instructions
    and GPUs, at the cost of behaviour logprobs that differ from a float32 learner's by bf16 rounding (the
    driver logs that gap as ``logprob_gap``).

    On CPU the fast path multiplies by oneDNN-packed copies of the projections, with q/k/v and gate/up stacked
    into one projection each (faster on small batches; it holds about two more copies of the projections). The
    engine owns ``model`` from here on: it moves it to ``device``, puts it in eval mode and updates its parameters
    in place; change them through ``load_weights`` only, which also re-makes those copies. Call it from one event
    loop at a time.

    With ``native_kernels`` (the default), a float32 fast path on CPU decodes with a native attention kernel
    (``rlfabric.engines.native``: RoPE, KV-cache write and attention in one pass, built on first use), else with
    torch ops; both give the same tokens and logprobs to float32 rounding. ``attention`` says which is in use (a
    layout the kernel refuses at run time switches the engine to torch ops, with a warning).

    Multi-turn callers pass a session key per prompt (``generate(..., sessions=)``): on the fast path a finished
    request's KV stays in a session cache of up to ``session_cache_mb`` (least recently stored evicted first;
    cleared at every weight update), and the session's next prompt prefills only the tokens past what it shares
    with the stored ones (``rlfabric.engines.session_cache``). ``stats()`` counts prefilled and reused tokens.
    ``SamplingParams.stop`` strings need a tokenizer (``tokenizer_or_eos_ids``) to read the completions' text.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer_or_eos_ids: Any = None,
        *,
        max_batch_size: int = 256,
        max_seq_len: int | None = None,
        device: str | torch.device | None = None,
        seed: int = 0,
        use_fast_path: bool = True,
        version: int = 0,
        matmul_dtype: torch.dtype | str | None = None,
        native_kernels: bool = True,
        session_cache_mb: float = 1024.0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"TorchEngine max_batch_size = {max_batch_size}: must be at least 1")
        self.model = (model if device is None else model.to(device)).eval()
        self.device = next(self.model.parameters()).device
        self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
        self.max_seq_len = max_seq_len or getattr(self.model.config, "max_position_embeddings", None)
        if not self.max_seq_len:
            raise ValueError("TorchEngine: the model config has no max_position_embeddings; pass max_seq_len")
        self.eos_ids = _stop_ids(tokenizer_or_eos_ids, self.model)
        self.tokenizer = tokenizer_or_eos_ids if hasattr(tokenizer_or_eos_ids, "decode") else None
        self.version = version
        if session_cache_mb < 0:
            raise ValueError(f"TorchEngine session_cache_mb = {session_cache_mb}: must be >= 0 (0 keeps no sessions)")

        matmul_dtype = resolve_matmul_dtype(matmul_dtype, "TorchEngine matmul_dtype")

        reason = fast_path_unsupported_reason(self.model, self.max_seq_len) if use_fast_path else "use_fast_path=False"
        self.fallback_reason: str | None = reason  # None: the fast path is in use
        self._decoder: FastDecoder | HFDecoder = on_compute_thread(
            FastDecoder if reason is None else HFDecoder,  # the fast one converts weights: torch compute
            self.model,
            max_batch_size,
            *((self.max_seq_len,) if reason is None else ()),
            matmul_dtype=matmul_dtype,
            **({"native_kernels": native_kernels, "session_cache_mb": session_cache_mb} if reason is None else {}),
        )
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._params = dict(self.model.state_dict(keep_vars=True))  # HF name -> live tensor, tied names included

        self._waiting: deque[EngineRequest] = deque()
        self._swaps: deque[_Swap] = deque()
        # The compute thread runs every model step (and every weight copy), so they never overlap.
        self._executor = compute_thread()
        self._step_lock = threading.Lock()
        self._scheduler: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._epoch = 0  # bumped with every new scheduler: compute loops of an older one stop
        self._closed = False

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", **kwargs: Any
    ) -> TorchEngine:
        """Load a Hugging Face model (and its tokenizer, when the directory has one) from a path or hub id.

        float32 by default, on GPU too, so behaviour logprobs match a float32 learner's; ``dtype=torch.bfloat16``
        halves memory and time on GPU at that cost, and ``matmul_dtype="bfloat16"`` (see the class) speeds up
        the matrix multiplications alone.
        """
        from rlfabric.models.hf import load_causal_lm, load_tokenizer

        model = on_compute_thread(load_causal_lm, path, dtype=dtype, device=device)
        if "tokenizer_or_eos_ids" not in kwargs:
            try:
                kwargs["tokenizer_or_eos_ids"] = load_tokenizer(path)
            except (OSError, ValueError):  # no tokenizer files: the model config's EOS ids will do
                pass
        return cls(model, device=device, **kwargs)

    @property
    def uses_fast_path(self) -> bool:
        return self.fallback_reason is None

    @property
    def attention(self) -> str:
        """Which attention decodes: the native kernel, or torch ops and why."""
        if isinstance(self._decoder, FastDecoder):
            return self._decoder.native_note
        return f"the model's own (fallback decoder: {self.fallback_reason})"

    @property
    def num_running(self) -> int:
        return len(self._decoder.running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def stats(self) -> dict[str, int]:
        """Prompt tokens prefilled, prompt tokens continued from a stored session instead, sessions stored now and
        sessions evicted for room, since the engine started."""
        sessions = getattr(self._decoder, "sessions", None)
        return {
            "prefill_tokens": self._decoder.prefill_tokens,
            "reused_tokens": self._decoder.reused_tokens,
            "sessions": len(sessions) if sessions is not None else 0,
            "session_evictions": sessions.evictions if sessions is not None else 0,
        }

    # -- the Engine contract -------------------------------------------------------------------------------------

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, sessions: list[str | None] | None = None
    ) -> list[Completion]:
        """One completion per prompt, in order. Safe to call from many coroutines at once. ``sessions``: one key
        (or None) per prompt, to continue that conversation's stored KV (see the class)."""
        self._check_open()
        for i, prompt in enumerate(prompts):
            self._check_prompt(i, prompt, params)
        if sessions is not None and len(sessions) != len(prompts):
            raise ValueError(f"generate: {len(sessions)} sessions for {len(prompts)} prompts (one key or None each)")
        stop_text = self._stop_text(params.stop)
        loop = self._ensure_scheduler()
        stop_ids = self.eos_ids | frozenset(params.stop_token_ids)
        keys = sessions if sessions is not None else [None] * len(prompts)
        requests = [
            EngineRequest(list(prompt), params, stop_ids, loop.create_future(), session=key, stop_text=stop_text)
            for prompt, key in zip(prompts, keys, strict=True)
        ]
        self._waiting.extend(requests)
        self._wakeup.set()
        try:
            return list(await asyncio.gather(*(r.future for r in requests)))
        finally:  # if the caller is cancelled, its unfinished requests are abandoned and free their slots
            for r in requests:
                r.future.cancel()

    async def load_weights(self, state_dict: dict[str, torch.Tensor], version: int, *, strict: bool = True) -> None:
        """Copy ``state_dict`` into the model in place (HF names) and tag later completions with ``version``.

        Running requests finish on the old weights first; requests that arrive meanwhile wait for the swap.
        The names and shapes are checked before anything waits or changes. ``strict=False`` allows a partial
        update (missing names keep their values); unknown names and shape mismatches are always errors.
        """
        self._check_open()
        self._validate_state_dict(state_dict, strict)
        loop = self._ensure_scheduler()
        swap = _Swap(state_dict, version, loop.create_future())
        self._swaps.append(swap)
        self._wakeup.set()
        await swap.future

    async def shutdown(self) -> None:
        """Fail queued and running requests, stop the scheduler and free the cache. The engine is unusable after."""
        if self._closed:
            return
        self._closed = True
        error = RuntimeError("TorchEngine was shut down")
        self._fail_all(error)
        if self._scheduler is not None and not self._scheduler.done():
            self._scheduler.cancel()
            try:
                await self._scheduler
            except asyncio.CancelledError:
                pass
        await asyncio.wrap_future(self._executor.submit(lambda: None))  # a step still running finishes first
        self._decoder.close()

    def _stop_text(self, stops: tuple[str, ...]) -> Callable[[list[int]], bool] | None:
        """A check of generated tokens for the stop strings, or None when there are none. Text as vLLM matches
        it: special tokens left out. It decodes only the last tokens that could hold a stop string completed by the
        newest one (a text token is at least a character; the margin allows for special tokens between), since
        any earlier match would have stopped the request then."""
        if not stops:
            return None
        if self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs the TorchEngine to have a tokenizer (tokenizer_or_eos_ids)")
        decode, window = self.tokenizer.decode, 2 * max(map(len, stops)) + 8

        def holds_stop(tokens: list[int]) -> bool:
            text = decode(tokens[-window:], skip_special_tokens=True)
            return any(stop in text for stop in stops)

        return holds_stop

    # -- checks --------------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TorchEngine was shut down")

    def _check_prompt(self, index: int, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError(f"prompt {index} is empty: generation needs at least one prompt token")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:  # caught here, it cannot fail a whole batch
            raise ValueError(f"prompt {index} has token ids outside the vocabulary [0, {self.vocab_size})")
        total = len(prompt) + params.max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(
                f"prompt {index}: {len(prompt)} prompt tokens + max_new_tokens {params.max_new_tokens} = {total} "
                f"exceeds the engine's max_seq_len {self.max_seq_len}"
            )

    def _validate_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool) -> None:
        unknown = sorted(set(state_dict) - set(self._params))
        mismatched = [
            f"{name}: got {tuple(value.shape)}, model has {tuple(self._params[name].shape)}"
            for name, value in state_dict.items()
            if name in self._params and tuple(value.shape) != tuple(self._params[name].shape)
        ]
        # Tied weights have several names for one tensor; sending any one of them covers it.
        given = {id(self._params[name]) for name in state_dict if name in self._params}
        missing = sorted(name for name, t in self._params.items() if id(t) not in given) if strict else []
        problems = []
        if unknown:
            problems.append(f"unknown names {_shorten(unknown)}")
        if missing:
            problems.append(f"missing names {_shorten(missing)} (pass strict=False for a partial update)")
        if mismatched:
            problems.append(f"shape mismatches {_shorten(mismatched)}")
        if problems:
            raise ValueError(f"load_weights: state_dict does not fit the model: {'; '.join(problems)}")

    # -- scheduler -----------------------------------------------------------------------------------------------

    def _ensure_scheduler(self) -> asyncio.AbstractEventLoop:
        """Start the scheduler task on the running loop (again, if an earlier loop has gone, as with asyncio.run)."""
        loop = asyncio.get_running_loop()
        if self._scheduler is None or self._scheduler.done() or self._scheduler.get_loop() is not loop:
            # Requests and swaps left from a dead loop have futures no one can await any more.
            with self._step_lock:  # a step of the old loop may still be finishing on the compute thread
                self._waiting.clear()
                self._swaps.clear()
                self._decoder.reset()
                self._epoch += 1
            self._wakeup = asyncio.Event()
            self._scheduler = loop.create_task(self._run(), name="torch-engine-scheduler")
        return loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self._has_work():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                await loop.run_in_executor(self._executor, self._compute, loop, self._epoch)
        except Exception as error:  # never leave callers waiting on a dead scheduler; the next call restarts it
            self._fail_all(error)
            raise

    def _has_work(self) -> bool:
        return bool(self._waiting or self._swaps or self._decoder.running)

    def _compute(self, loop: asyncio.AbstractEventLoop, epoch: int) -> None:
        """Step on the compute thread while there is work, handing each step's results to the event loop as they
        come. Staying here between steps saves two thread wake-ups per token (about 5% of a generation on two
        cores); requests that arrive meanwhile are admitted at the next step."""
        while self._has_work():
            result = self._step(epoch)
            if result is None:  # a newer scheduler took over
                return
            if result.finished or result.swapped or result.failed:
                try:
                    loop.call_soon_threadsafe(self._deliver, result)
                except RuntimeError:  # the loop has closed: its callers are gone
                    return

    def _deliver(self, result: _StepResult) -> None:
        for request in result.finished:
            if request.future.done():  # done already: its caller was cancelled
                continue
            if self._closed:  # finished, but not handed over before shutdown: it fails with the rest
                request.future.set_exception(RuntimeError("TorchEngine was shut down"))
            else:
                request.future.set_result(request.completion())
        for swap in result.swapped:
            if not swap.future.done():
                swap.future.set_result(None)
        for work in result.failed:  # a failed step fails its own requests, not the engine
            if not work.future.done():
                work.future.set_exception(result.error)

    def _step(self, epoch: int) -> _StepResult | None:
        """One scheduler step: a weight swap when idle, else admit + decode one token. None when the scheduler
        that asked (``epoch``) has been replaced."""
        with self._step_lock, torch.inference_mode():
            if epoch != self._epoch:
                return None
            if self._swaps and not self._decoder.running:
                return self._apply_swap()
            admitted = self._admit() if not self._swaps else []  # a pending swap holds admission
            if not admitted and not self._decoder.running:
                return _StepResult()
            try:
                return _StepResult(finished=self._decoder.step(admitted, self._generator))
            except Exception as error:
                failed = list(dict.fromkeys(self._decoder.running + admitted))
                self._decoder.reset()
                return _StepResult(error=error, failed=failed)

    def _admit(self) -> list[EngineRequest]:
        """Waiting requests for the free slots, stamped with the version that will generate them."""
        admitted: list[EngineRequest] = []
        free = self._decoder.free_slots()
        while self._waiting and len(admitted) < free:
            request = self._waiting.popleft()
            if not request.abandoned:
                request.version = self.version
                admitted.append(request)
        return admitted

    def _apply_swap(self) -> _StepResult:
        swap = self._swaps.popleft()
        if swap.future.done():  # its load_weights call was cancelled before the swap began: skip it
            return _StepResult()
        try:
            for name, value in swap.state_dict.items():
                self._params[name].data.copy_(torch.as_tensor(value), non_blocking=True)
            self._decoder.refresh_weights()
            self._decoder.forget_sessions()  # their keys and values came from the old weights
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the caller may reuse its tensors once we return
        except Exception as error:
            return _StepResult(error=error, failed=[swap])
        self.version = swap.version
        return _StepResult(swapped=[swap])

    def _fail_all(self, error: Exception) -> None:
        with self._step_lock:
            work = [*self._decoder.running, *self._waiting, *self._swaps]
            self._decoder.reset()
            self._waiting.clear()
            self._swaps.clear()
        for item in work:
            if not item.future.done():
                item.future.set_exception(error)


def _stop_ids(tokenizer_or_eos_ids: Any, model: nn.Module) -> frozenset[int]:
    """The stop tokens every request has (see ``TorchEngine``)."""
    model_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if model_eos is None:
        model_eos = getattr(model.config, "eos_token_id", None)
    model_ids = _as_ids(model_eos)
    if tokenizer_or_eos_ids is None:
        return model_ids
    if hasattr(tokenizer_or_eos_ids, "eos_token_id"):  # a tokenizer
        return model_ids | _as_ids(tokenizer_or_eos_ids.eos_token_id)
    return _as_ids(tokenizer_or_eos_ids)


def _as_ids(ids: int | Iterable[int] | None) -> frozenset[int]:
    if ids is None:
        return frozenset()
    if isinstance(ids, int):
        return frozenset({ids})
    return frozenset(int(i) for i in ids)


def _shorten(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}, ... {len(names) - limit} more]" if len(names) > limit else f"[{shown}]"
