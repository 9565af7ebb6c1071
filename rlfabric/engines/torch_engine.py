"""The torch generation engine: continuous batching over a KV cache, on CPU or GPU.

One scheduler task owns the model. ``generate`` calls from any number of coroutines enqueue one request per prompt
and await its future. Every scheduler step:

1. admits waiting requests into free batch slots and prefills them together (one padded forward),
2. decodes every running sequence by one token (one forward for the whole batch),
3. samples, and retires finished sequences at once, so the batch shrinks as sequences end instead of computing
   padding for them.

Steps run on the process's one compute thread (``compute_thread``: one OpenMP team per process), so the event
loop stays free for new requests and weight updates while the model computes (torch releases the GIL inside its
kernels).

Two decoders implement the steps:

* ``_FastDecoder`` (Llama, Qwen2 and Mistral families): the decoder forward written out here over a preallocated
  slot KV cache ``[layers, slots, kv_heads, length, head_dim]``. It reads the weights straight from the Hugging Face
  module's parameters (or, with ``matmul_dtype`` set, from copies of the projections in that dtype, re-made at
  every weight update). Transformers' ``generate`` spends much of its time on per-step plumbing (mask building,
  cache concatenation, logits processors) rather than matmuls; this path skips that.
* ``_HFDecoder`` (anything else, or ``use_fast_path=False``): static batches through the model's own forward and
  its own cache. Correct for any causal LM; slower.

Weight updates follow the contract in ``rlfabric.engines.base``: a swap waits until the running sequences finish
(they keep the old version), admission pauses meanwhile (new requests wait for the swap), then the tensors are
copied in place by Hugging Face name.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from rlfabric.engines import native
from rlfabric.engines.base import Completion, FinishReason, SamplingParams
from rlfabric.engines.session_cache import CachedPrefix, SessionCache
from rlfabric.models.precision import resolve_matmul_dtype

T = TypeVar("T")
log = logging.getLogger(__name__)
# attend(layer index, qk, v) -> attention output [n, heads * head_dim], for one decode step
DecodeAttentionStep = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]

# Model families whose decoder layer is: RMSNorm -> attention (q/k/v/o projections, RoPE, GQA) -> residual ->
# RMSNorm -> SwiGLU MLP -> residual. Their modules share names, so one forward serves all three.
FAST_PATH_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
# RoPE variants whose frequencies are fixed at construction. "dynamic" and "longrope" rescale with the sequence
# length on every call, so they take the fallback.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


# ----------------------------------------------------------------------------------------------------------------
# Requests and sampling
# ----------------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    future: asyncio.Future
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version: int = -1  # stamped at admission
    finish_reason: FinishReason | None = None
    session: str | None = None  # keep this conversation's KV for its next turn (rlfabric.engines.session_cache)
    stop_text: Callable[[list[int]], bool] | None = None  # True once the tokens' text holds a stop string

    @property
    def abandoned(self) -> bool:
        """The caller went away (its generate call was cancelled, e.g. by a deadline): stop spending compute."""
        return self.future.done()

    @property
    def final_length(self) -> int:
        """Cache positions this request may need: prompt plus every generated token."""
        return len(self.prompt) + self.params.max_new_tokens

    def append(self, token: int, logprob: float) -> bool:
        """Record one generated token; True when the request is finished."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids or (self.stop_text is not None and self.stop_text(self.tokens)):
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None or self.abandoned

    def completion(self) -> Completion:
        assert self.finish_reason is not None
        return Completion(self.prompt, self.tokens, self.logprobs, self.finish_reason, self.version)


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator
) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` [batch, vocab], each row with its own sampling parameters.

    Rows with temperature 0 take the argmax. The returned logprob is ``log_softmax(logits / temperature)`` of the
    chosen token (temperature 1 for greedy rows), before top-k/top-p truncation: the number the learner recomputes.
    """
    device = logits.device
    greedy = [p.temperature == 0 for p in params]
    temperature = torch.tensor([p.temperature or 1.0 for p in params], device=device)
    scaled = logits.float() / temperature[:, None]
    if all(greedy):
        tokens = scaled.argmax(-1)
    else:
        truncated = _truncate(scaled, params) if any(p.top_k or p.top_p < 1 for p in params) else scaled
        tokens = sample_from_probs(truncated.softmax(-1), generator)
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy, device=device), scaled.argmax(-1), tokens)
    logprobs = scaled.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), logprobs.tolist()


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of ``probs`` [batch, vocab], by inverting each row's CDF at one uniform draw.

    The same distribution as ``torch.multinomial(probs, 1)``, which on CPU draws an exponential per vocabulary
    entry: one random number per row instead makes it 6x faster at 80 tokens and 28x at 32,000. Zero-probability
    entries are never chosen (their CDF step is empty).
    """
    cdf = probs.cumsum(-1)
    draw = torch.rand(len(probs), 1, generator=generator, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, draw, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _truncate(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) the logits outside each row's top-k, then outside its top-p nucleus (transformers' order)."""
    device, vocab = scaled.device, scaled.shape[-1]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
    # top_p == 1 keeps everything; inf avoids dropping tail tokens whose cumulative mass rounds up to 1.
    top_p = torch.tensor([p.top_p if p.top_p < 1 else float("inf") for p in params], device=device)
    sorted_logits, order = scaled.sort(-1, descending=True)
    ranks = torch.arange(vocab, device=device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # the first token always stays: its mass_before is 0
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)


# ----------------------------------------------------------------------------------------------------------------
# Fast path: Llama-family forward over a slot KV cache
# ----------------------------------------------------------------------------------------------------------------


def fast_path_unsupported_reason(model: nn.Module, max_seq_len: int) -> str | None:
    """Why ``model`` cannot take the fast path (None when it can)."""
    config = model.config
    if config.model_type not in FAST_PATH_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {sorted(FAST_PATH_MODEL_TYPES)}"
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers") or not hasattr(body, "rotary_emb"):
        return f"{type(model).__name__} does not have the usual .model.layers/.model.rotary_emb layout"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    rope_type = getattr(body.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type {rope_type!r} (supported: {sorted(STATIC_ROPE_TYPES)})"
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    windowed = "sliding_attention" in layer_types if layer_types else window is not None
    if windowed and window is not None and window < max_seq_len:  # a window longer than any sequence is a no-op
        return f"sliding_window {window} < max_seq_len {max_seq_len}"
    head = model.get_output_embeddings()
    linears = [head] + [m for layer in body.layers for m in (*_attention_linears(layer), *_mlp_linears(layer))]
    if any(type(m) is not nn.Linear for m in linears):  # quantized or otherwise wrapped layers
        return "some projection is not a plain nn.Linear"
    return None


def _attention_linears(layer: nn.Module) -> tuple[nn.Linear, ...]:
    a = layer.self_attn
    return a.q_proj, a.k_proj, a.v_proj, a.o_proj


def _mlp_linears(layer: nn.Module) -> tuple[nn.Linear, ...]:
    m = layer.mlp
    return m.gate_proj, m.up_proj, m.down_proj


class _Norm(NamedTuple):
    weight: torch.Tensor
    eps: float


class _Linear:
    """A projection for the fast path: weight and bias in the matmul dtype, plus, on CPU, the weight prepacked
    into oneDNN's blocked layout (``packed``), which multiplies the small decode batches 1.3x-1.5x faster than
    ``F.linear`` (benchmarks/RESULTS.md). The pack is a copy: ``repack`` re-makes it after every weight load."""

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.packed: torch.Tensor | None = None

    @classmethod
    def of(cls, modules: tuple[nn.Linear, ...], dtype: torch.dtype, copies: list[_Copy]) -> _Linear:
        """One projection whose output is the modules' outputs side by side, in ``dtype``.

        One module already in ``dtype`` is used in place (its live parameters). Otherwise the projection is a copy:
        each (destination slice, live parameter) pair goes into ``copies``, which refresh the copy in place after
        every weight load (no reallocation).
        """
        if len(modules) == 1 and modules[0].weight.dtype == dtype:
            m = modules[0]
            return cls(m.weight.detach(), None if m.bias is None else m.bias.detach())

        def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
            out = torch.empty(
                (sum(len(t) for t in tensors), *tensors[0].shape[1:]), dtype=dtype, device=tensors[0].device
            )
            start = 0
            for t in tensors:
                copies.append(_Copy(out[start : start + len(t)], t))
                start += len(t)
            return out

        weight = stack([m.weight.detach() for m in modules])
        bias = None if modules[0].bias is None else stack([m.bias.detach() for m in modules])
        return cls(weight, bias)

    def repack(self) -> None:
        if packed_matmuls_available(self.weight.device, self.weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_BATCH_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


PACK_BATCH_HINT = 64  # oneDNN's layout hint; measured not to matter between 1 and 256 rows


def packed_matmuls_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacked linears: on CPU, in float32, or in bfloat16 where oneDNN supports it on this CPU, in a
    torch built with oneDNN. Elsewhere (GPU, other dtypes) the fast path uses ``F.linear``."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        return hasattr(ops, "_is_mkldnn_bf16_supported") and bool(ops._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class _Copy(NamedTuple):
    """A decoder-owned copy of (part of) a parameter: ``destination.copy_(source)`` brings it up to date."""

    destination: torch.Tensor
    source: torch.Tensor


class _LayerParams(NamedTuple):
    """One decoder layer's weights: norms by reference, projections in the decoder's matmul dtype.

    ``attn_in`` (q, k, v) and ``mlp_in`` (gate, up) are each one stacked projection or one per module (see
    ``_projections``).
    """

    attn_norm: _Norm
    attn_in: tuple[_Linear, ...]
    qk_dim: int  # width of q and k together: where v starts in a stacked projection's output
    o: _Linear
    mlp_norm: _Norm
    mlp_in: tuple[_Linear, ...]
    down: _Linear

    @classmethod
    def of(cls, layer: nn.Module, matmul_dtype: torch.dtype, copies: list[_Copy]) -> _LayerParams:
        q, k, v, o = _attention_linears(layer)
        gate, up, down = _mlp_linears(layer)
        return cls(
            _Norm(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
            _projections((q, k, v), matmul_dtype, copies),
            q.out_features + k.out_features,
            _Linear.of((o,), matmul_dtype, copies),
            _Norm(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
            _projections((gate, up), matmul_dtype, copies),
            _Linear.of((down,), matmul_dtype, copies),
        )


def _projections(modules: tuple[nn.Linear, ...], dtype: torch.dtype, copies: list[_Copy]) -> tuple[_Linear, ...]:
    """Projections of one input: one stacked matmul, or one per module.

    One wide matmul beats several narrow ones on decode batches (q, k and v of the benchmark model: 1.6x; gate
    and up: 1.35x; benchmarks/RESULTS.md). Stacking needs a copy of the weights, so it happens where they are
    copied anyway: into another matmul dtype, or into oneDNN packs on CPU. On GPU in the model's own dtype the
    live parameters serve in place (no second copy of the model in GPU memory).
    """
    weight = modules[0].weight
    same_bias = len({m.bias is None for m in modules}) == 1
    copied = weight.dtype != dtype or packed_matmuls_available(weight.device, dtype)
    if same_bias and copied:
        return (_Linear.of(modules, dtype, copies),)
    return tuple(_Linear.of((m,), dtype, copies) for m in modules)


def _rms_norm(x: torch.Tensor, norm: _Norm) -> torch.Tensor:
    """Transformers' RMSNorm: normalise in float32, cast back, then scale (in that order, so outputs match).

    One fused kernel instead of transformers' six elementwise ops: per-op overhead is a large share of a decode
    step on small models.
    """
    if x.dtype == torch.float32:  # no casts, so the scaling can join the kernel
        return F.rms_norm(x, x.shape[-1:], norm.weight, norm.eps)
    return norm.weight * F.rms_norm(x.float(), x.shape[-1:], eps=norm.eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it: ``x * cos + rotate_half(x) * sin``, rotate_half(x) being
    (-x2, x1). Here the minus lives in the table (``signed_sin`` = (-sin1, sin2), see ``_rope_table``), so this
    is (x2, x1) * signed_sin: a kernel fewer, the same numbers in every dtype (negation is exact)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin


def _mlp(x: torch.Tensor, p: _LayerParams) -> torch.Tensor:
    """SwiGLU in the matmul dtype."""
    x = x.to(p.down.weight.dtype)
    if len(p.mlp_in) == 1:
        gate, up = p.mlp_in[0](x).chunk(2, dim=-1)
    else:
        gate, up = (m(x) for m in p.mlp_in)
    return p.down(F.silu(gate) * up)


def _project_qkv(h: torch.Tensor, p: _LayerParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(q and k side by side [..., qk_dim], v), computed in the matmul dtype, returned in the activations' dtype.

    q and k come together because RoPE then runs once for both; from a stacked projection both parts are views.
    """
    h_mm = h.to(p.o.weight.dtype)
    outs = [m(h_mm).to(h.dtype) for m in p.attn_in]
    if len(outs) == 1:
        return outs[0][..., : p.qk_dim], outs[0][..., p.qk_dim :]
    return torch.cat(outs[:2], dim=-1), outs[2]


def _out_proj(out: torch.Tensor, p: _LayerParams) -> torch.Tensor:
    return p.o(out.to(p.o.weight.dtype))


def _runs(values: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal neighbours as ``(start, stop, value)``: ``[4, 4, 7]`` -> ``[(0, 2, 4), (2, 3, 7)]``."""
    runs: list[tuple[int, int, int]] = []
    for i, value in enumerate(values):
        if runs and runs[-1][2] == value:
            runs[-1] = (runs[-1][0], i + 1, value)
        else:
            runs.append((i, i + 1, value))
    return runs


class _FastDecoder:
    """Continuous batching for Llama-family models over a slot KV cache.

    Running sequences always occupy slots ``[0, n)``: a retired sequence's slot is filled by moving a later one
    into it, so every decode step works on plain slices of the cache instead of gathering scattered slots.
    The cache grows (slots and length, doubling) up to ``max_batch_size`` x ``max_seq_len`` as requests need it.
    A finished request with a session key leaves its KV rows in ``sessions`` (at most ``session_cache_mb``), for
    its session's next request to continue from (``_prefill_continued``).
    """

    def __init__(
        self,
        model: nn.Module,
        max_batch_size: int,
        max_seq_len: int,
        matmul_dtype: torch.dtype | None = None,
        native_kernels: bool = True,
        session_cache_mb: float = 1024.0,
    ) -> None:
        config, body = model.config, model.model
        attn = body.layers[0].self_attn
        self.matmul_dtype = matmul_dtype or body.embed_tokens.weight.dtype
        self.copies: list[_Copy] = []
        self.layers = [_LayerParams.of(layer, self.matmul_dtype, self.copies) for layer in body.layers]
        self.embed = body.embed_tokens.weight
        self.final_norm = _Norm(body.norm.weight, body.norm.variance_epsilon)
        # The LM head stays in the model's dtype (logprobs as the learner computes them); tied or untied, the
        # module knows its weight.
        self.head = _Linear.of((model.get_output_embeddings(),), self.embed.dtype, self.copies)
        self.linears = [*(m for p in self.layers for m in (*p.attn_in, p.o, *p.mlp_in, p.down)), self.head]
        self.refresh_weights()
        self.rotary = body.rotary_emb
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        self.gqa = self.n_kv_heads != self.n_heads
        self.device, self.dtype = self.embed.device, self.embed.dtype
        self.max_slots, self.max_len = max_batch_size, max_seq_len
        self.native, self.native_note = self._native_kernels(native_kernels)

        self.k_cache = self.v_cache = self._new_cache(slots=0, length=0)
        self.cos = self.signed_sin = torch.empty(0, self.head_dim, device=self.device, dtype=self.dtype)
        # Per slot: its request, the number of tokens in its cache, and the sampled token still to feed.
        self.slots: list[_Request] = []
        self.lengths: list[int] = []
        self.pending: list[int] = []
        token_bytes = 2 * len(self.layers) * self.n_kv_heads * self.head_dim * self.dtype.itemsize  # keys + values
        self.sessions = SessionCache(int(session_cache_mb * 2**20) // token_bytes)
        self.prefill_tokens = 0  # prompt tokens run through the model
        self.reused_tokens = 0  # prompt tokens whose KV came from a session instead

    def _native_kernels(self, wanted: bool) -> tuple[native.DecodeKernels | None, str]:
        """(the native decode kernels or None, a note on which attention decodes and why)."""
        if not wanted:
            return None, "torch attention (native_kernels=False)"
        if self.device.type != "cpu" or self.dtype != torch.float32:
            where = f"{self.dtype} on {self.device}"
            return None, f"torch attention (the native kernel is for float32 on CPU; this is {where})"
        if self.head_dim > native.MAX_HEAD_DIM:
            return None, f"torch attention (head_dim {self.head_dim} > the native kernel's {native.MAX_HEAD_DIM})"
        kernels = native.decode_kernels()
        if kernels is None:
            return None, f"torch attention ({native.unavailable_reason()})"
        return kernels, "native decode attention"

    @property
    def running(self) -> list[_Request]:
        return self.slots

    def refresh_weights(self) -> None:
        """Bring the decoder's copies of the projections up to date after an in-place weight update: converted
        copies into the same buffers (no allocation), then the oneDNN packs (see ``_Linear``)."""
        for copy in self.copies:
            copy.destination.copy_(copy.source)
        for linear in self.linears:
            linear.repack()

    def free_slots(self) -> int:
        return self.max_slots - len(self.slots)

    def reset(self) -> None:
        self.slots, self.lengths, self.pending = [], [], []

    def close(self) -> None:
        self.reset()
        self.forget_sessions()
        self.k_cache = self.v_cache = self._new_cache(slots=0, length=0)  # frees the memory

    def forget_sessions(self) -> None:
        """Drop the stored sessions (after a weight update their keys and values are stale)."""
        self.sessions.clear()

    def step(self, admitted: list[_Request], generator: torch.Generator) -> list[_Request]:
        """Decode the running sequences one token, prefill the admitted ones; return the requests that finished."""
        n_running = len(self.slots)
        fresh, continued = self._take_sessions(admitted)
        admitted = fresh + [request for request, _ in continued]
        self._reserve(n_running + len(admitted), max(r.final_length for r in self.slots + admitted))
        logits = []
        if n_running:
            logits.append(self._decode(n_running))
        if fresh:
            logits.append(self._prefill(fresh, first_slot=n_running))
        if continued:
            logits.append(self._prefill_continued(continued, first_slot=n_running + len(fresh)))
        tokens, logprobs = sample_tokens(torch.cat(logits), [r.params for r in self.slots], generator)

        done_slots = []
        for slot, (request, token, logprob) in enumerate(zip(self.slots, tokens, logprobs, strict=True)):
            self.pending[slot] = token
            if request.append(token, logprob):
                done_slots.append(slot)
        done = [self.slots[s] for s in done_slots]
        self._keep_sessions(done_slots)
        self._retire(done_slots)
        return done

    # -- sessions ------------------------------------------------------------------------------------------------

    def _take_sessions(self, admitted: list[_Request]) -> tuple[list[_Request], list[tuple[_Request, CachedPrefix]]]:
        """The admitted requests split into those prefilled from scratch and those continuing a stored session."""
        fresh, continued = [], []
        for request in admitted:
            prefix = None if request.session is None else self.sessions.take(request.session, request.prompt)
            if prefix is None:
                fresh.append(request)
            else:
                continued.append((request, prefix))
        return fresh, continued

    def _keep_sessions(self, done_slots: list[int]) -> None:
        """Store the KV rows of the finished requests that have a session key. A slot holds the prompt and every
        sampled token but the last (sampled, never fed back)."""
        for slot in done_slots:
            request, length = self.slots[slot], self.lengths[slot]
            if request.session is None or length > self.sessions.max_tokens:
                continue
            tokens = (request.prompt + request.tokens)[:length]
            keys = self.k_cache[:, slot, :, :length].clone()
            self.sessions.put(request.session, CachedPrefix(tokens, keys, self.v_cache[:, slot, :, :length].clone()))

    # -- cache management ----------------------------------------------------------------------------------------

    def _reserve(self, slots: int, length: int) -> None:
        """Grow the cache (amortised doubling, capped by the engine limits) to hold ``slots`` x ``length``."""
        _, have_slots, _, have_len, _ = self.k_cache.shape
        if slots <= have_slots and length <= have_len:
            return
        new_slots = min(self.max_slots, max(slots, 2 * have_slots, 8))
        new_len = min(self.max_len, max(length, 2 * have_len, 64))
        n, used = len(self.slots), max(self.lengths, default=0)
        for name in ("k_cache", "v_cache"):
            old, new = getattr(self, name), self._new_cache(new_slots, new_len)
            new[:, :n, :, :used] = old[:, :n, :, :used]
            setattr(self, name, new)
        if new_len > self.cos.shape[0]:
            self.cos, self.signed_sin = self._rope_table(new_len)

    def _new_cache(self, slots: int, length: int) -> torch.Tensor:
        shape = (len(self.layers), slots, self.n_kv_heads, length, self.head_dim)
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    def _rope_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (see ``_rope``) for positions [0, length), from the model's own rotary module (theta,
        scaling and all)."""
        positions = torch.arange(length, device=self.device)[None]
        probe = torch.empty(1, device=self.device, dtype=self.dtype)  # the module only reads its device and dtype
        cos, sin = self.rotary(probe, positions)
        cos, sin = cos[0], sin[0]
        half = sin.shape[-1] // 2
        # Both contiguous: the native attention kernel reads them by row.
        return cos.contiguous(), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    def _retire(self, done_slots: list[int]) -> None:
        """Free the finished slots, moving the running sequences above the new end into the holes (one copy)."""
        if not done_slots:
            return
        n, done = len(self.slots), set(done_slots)
        keep = n - len(done)
        holes = [s for s in done_slots if s < keep]
        movers = [s for s in range(keep, n) if s not in done]  # as many as holes
        if movers:
            used = max(self.lengths[s] for s in movers)
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            for cache in (self.k_cache, self.v_cache):
                cache[:, dst, :, :used] = cache[:, src, :, :used]
            for h, m in zip(holes, movers, strict=True):
                self.slots[h], self.lengths[h], self.pending[h] = self.slots[m], self.lengths[m], self.pending[m]
        del self.slots[keep:], self.lengths[keep:], self.pending[keep:]

    # -- forward passes ------------------------------------------------------------------------------------------

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **mask: Any) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=self.gqa, **mask)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(_rms_norm(hidden, self.final_norm))

    def _prefill(self, admitted: list[_Request], first_slot: int) -> torch.Tensor:
        """Run the admitted prompts and fill their slots; return the logits at each prompt's last token.

        Identical prompts (a group of samples for one prompt, as in GRPO) run once and their cache is copied to
        every slot that needs it. Prompts are right-padded to one width; that needs no mask beyond the causal
        one, since real tokens come first and never see the padding. The padding's own cache entries lie past
        each slot's length: decode masks them and then overwrites them.
        """
        distinct: dict[tuple[int, ...], int] = {}
        row_of = [distinct.setdefault(tuple(r.prompt), len(distinct)) for r in admitted]  # admitted -> distinct
        prompts = list(distinct)
        lengths = [len(prompt) for prompt in prompts]
        batch, width = len(prompts), max(lengths)
        ids = torch.tensor([[*prompt, *[0] * (width - len(prompt))] for prompt in prompts], device=self.device)
        runs = _runs(row_of)
        gather = None if batch == len(admitted) else torch.tensor(row_of, device=self.device)

        def fill(cache: torch.Tensor, rows: torch.Tensor) -> None:
            """Write the distinct prompts' rows into the admitted requests' slots, a run of repeats at a time (one
            broadcast copy each, no gathered temporary)."""
            for start, stop, row in runs:
                cache[first_slot + start : first_slot + stop, :, :width] = rows[row]

        cos, signed_sin = self.cos[:width], self.signed_sin[:width]  # broadcast: [batch, heads, width, head_dim]

        x = F.embedding(ids, self.embed)
        for i, p in enumerate(self.layers):
            qk, v = _project_qkv(_rms_norm(x, p.attn_norm), p)
            qk = qk.view(batch, width, self.n_heads + self.n_kv_heads, self.head_dim).transpose(1, 2)
            qk = _rope(qk, cos, signed_sin)
            q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
            v = v.view(batch, width, self.n_kv_heads, self.head_dim).transpose(1, 2)
            fill(self.k_cache[i], k)
            fill(self.v_cache[i], v)
            out = self._attend(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, width, -1)
            x = x + _out_proj(out, p)
            x = x + _mlp(_rms_norm(x, p.mlp_norm), p)

        self.slots += admitted
        self.lengths += [len(r.prompt) for r in admitted]
        self.pending += [0] * len(admitted)  # set from the sampled tokens
        self.prefill_tokens += sum(lengths)
        last = x[torch.arange(batch, device=self.device), torch.tensor(lengths, device=self.device) - 1]
        logits = self._logits(last)
        return logits if gather is None else logits.index_select(0, gather)

    def _prefill_continued(self, continued: list[tuple[_Request, CachedPrefix]], first_slot: int) -> torch.Tensor:
        """Prefill requests that continue a session: each one's stored KV goes back into its slot and only its
        prompt's new tokens (past the stored ones) run, attending to it. Return the logits at each prompt's end.

        Rows are right-padded to one width and query position ``p`` of a row sees that row's keys ``<= p``.
        Padding positions write no keys (so no row writes past its prompt); their outputs are dropped.
        """
        device, heads, kv_heads, head_dim = self.device, self.n_heads, self.n_kv_heads, self.head_dim
        batch = len(continued)
        reused = [len(prefix.tokens) for _, prefix in continued]
        suffixes = [request.prompt[start:] for (request, _), start in zip(continued, reused, strict=True)]
        width, span = max(map(len, suffixes)), max(len(request.prompt) for request, _ in continued)
        for slot, (_, prefix) in enumerate(continued, start=first_slot):
            self.k_cache[:, slot, :, : len(prefix.tokens)] = prefix.keys
            self.v_cache[:, slot, :, : len(prefix.tokens)] = prefix.values

        ids = torch.tensor([[*suffix, *[0] * (width - len(suffix))] for suffix in suffixes], device=device)
        offsets = torch.arange(width, device=device)[None, :]
        positions = torch.tensor(reused, device=device)[:, None] + offsets  # [batch, width]
        valid = offsets < torch.tensor([len(suffix) for suffix in suffixes], device=device)[:, None]
        hidden = torch.arange(span, device=device)[None, None, :] > positions[:, :, None]  # [batch, width, span]
        mask = torch.zeros(batch, 1, width, span, device=device, dtype=self.dtype)
        mask.masked_fill_(hidden[:, None], float("-inf"))
        table_rows = positions.clamp(max=self.cos.shape[0] - 1)  # padding may run past the table; it is dropped
        cos, signed_sin = self.cos[table_rows][:, None], self.signed_sin[table_rows][:, None]
        # Cache rows of the real positions, in a layer's cache seen as [slots * kv_heads * length, head_dim].
        written = valid[:, None, :].expand(batch, kv_heads, width)
        slot_heads = torch.arange(first_slot * kv_heads, (first_slot + batch) * kv_heads, device=device)
        rows = (slot_heads.view(batch, kv_heads, 1) * self.k_cache.shape[3] + positions[:, None, :])[written]
        slots = slice(first_slot, first_slot + batch)

        x = F.embedding(ids, self.embed)
        for i, p in enumerate(self.layers):
            qk, v = _project_qkv(_rms_norm(x, p.attn_norm), p)
            qk = _rope(qk.view(batch, width, heads + kv_heads, head_dim).transpose(1, 2), cos, signed_sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = v.view(batch, width, kv_heads, head_dim).transpose(1, 2)
            k_cache, v_cache = self.k_cache[i], self.v_cache[i]
            k_cache.view(-1, head_dim).index_copy_(0, rows, k[written])
            v_cache.view(-1, head_dim).index_copy_(0, rows, v[written])
            out = self._attend(q, k_cache[slots, :, :span], v_cache[slots, :, :span], attn_mask=mask)
            x = x + _out_proj(out.transpose(1, 2).reshape(batch, width, -1), p)
            x = x + _mlp(_rms_norm(x, p.mlp_norm), p)

        self.slots += [request for request, _ in continued]
        self.lengths += [len(request.prompt) for request, _ in continued]
        self.pending += [0] * batch
        self.prefill_tokens += sum(map(len, suffixes))
        self.reused_tokens += sum(reused)
        last = torch.tensor([len(suffix) - 1 for suffix in suffixes], device=device)
        return self._logits(x[torch.arange(batch, device=device), last])

    def _decode(self, n: int) -> torch.Tensor:
        """Feed each running slot its pending token at position ``lengths[slot]``; logits for the next one."""
        positions = torch.tensor(self.lengths[:n], device=self.device)
        tokens = torch.tensor(self.pending[:n], device=self.device)
        if self.native is not None:
            try:
                return self._decode_with(self._native_decode_attention(n, positions), n, tokens)
            except (TypeError, ValueError) as error:
                # A layout the kernel's checks refuse (it then wrote nothing): torch ops from here on. Redoing the
                # step is safe: it rewrites the same cache rows and moves no length until it completes.
                self.native, self.native_note = None, f"torch attention (the native kernel refused: {error})"
                log.warning("rlfabric: TorchEngine decodes with %s", self.native_note)
        return self._decode_with(self._torch_decode_attention(n, positions), n, tokens)

    def _decode_with(self, attend: DecodeAttentionStep, n: int, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.embed)  # [n, hidden]
        for i, p in enumerate(self.layers):
            qk, v = _project_qkv(_rms_norm(x, p.attn_norm), p)
            x += _out_proj(attend(i, qk, v), p)
            x += _mlp(_rms_norm(x, p.mlp_norm), p)

        for slot in range(n):
            self.lengths[slot] += 1
        return self._logits(x)

    def _native_decode_attention(self, n: int, positions: torch.Tensor) -> DecodeAttentionStep:
        """One decode step's attention for layer i by the native kernel (RoPE, cache write, attention in one)."""
        kernel, max_position = self.native.attention, max(self.lengths[:n])
        out = torch.empty(n, self.n_heads * self.head_dim, device=self.device, dtype=self.dtype)  # reused per layer

        def attend(i: int, qk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return kernel(
                qk, v, self.cos, self.signed_sin, positions, max_position, self.k_cache[i], self.v_cache[i],
                self.scale, out,
            )  # fmt: skip

        return attend

    def _torch_decode_attention(self, n: int, positions: torch.Tensor) -> DecodeAttentionStep:
        """The same as ``_native_decode_attention`` in torch ops: RoPE, two cache writes and SDPA under a mask."""
        heads, kv_heads, head_dim = self.n_heads, self.n_kv_heads, self.head_dim
        span = max(self.lengths[:n]) + 1  # cache positions any slot can see this step
        # Additive mask, made once per step (a boolean one is converted inside every attention call).
        hidden = torch.arange(span, device=self.device)[None, :] > positions[:, None]
        mask = torch.zeros(n, 1, 1, span, device=self.device, dtype=self.dtype).masked_fill_(
            hidden.view(n, 1, 1, span), float("-inf")
        )
        cos, signed_sin = self.cos[positions][:, None, None, :], self.signed_sin[positions][:, None, None, :]
        # Where each new key/value row goes in a layer's cache seen as [slots * kv_heads * length, head_dim]:
        # one index_copy_ per cache instead of an index_put with two index tensors.
        capacity = self.k_cache.shape[3]
        slot_heads = torch.arange(n * kv_heads, device=self.device).view(n, kv_heads)
        rows = (slot_heads * capacity + positions[:, None]).view(-1)

        def attend(i: int, qk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qk = _rope(qk.view(n, heads + kv_heads, 1, head_dim), cos, signed_sin)
            q, k = qk[:, :heads], qk[:, heads:]
            k_cache, v_cache = self.k_cache[i], self.v_cache[i]
            k_cache.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim))
            v_cache.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim))
            out = self._attend(q, k_cache[:n, :, :span], v_cache[:n, :, :span], attn_mask=mask)
            return out.view(n, -1)

        return attend


# ----------------------------------------------------------------------------------------------------------------
# Fallback: static batches through the model's own forward
# ----------------------------------------------------------------------------------------------------------------


class _HFDecoder:
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
    def running(self) -> list[_Request]:
        return self.rows

    def free_slots(self) -> int:
        return 0 if self.rows else self.max_batch_size

    def reset(self) -> None:
        self.rows: list[_Request] = []
        self.cache: Any = None
        self.mask = self.positions = self.pending = None

    def close(self) -> None:
        self.reset()

    def step(self, admitted: list[_Request], generator: torch.Generator) -> list[_Request]:
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

    def _prefill(self, admitted: list[_Request]) -> torch.Tensor:
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


# ----------------------------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------------------------

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

    finished: list[_Request] = field(default_factory=list)
    swapped: list[_Swap] = field(default_factory=list)
    error: Exception | None = None
    failed: list[_Request | _Swap] = field(default_factory=list)  # the work ``error`` broke


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
        self._decoder: _FastDecoder | _HFDecoder = on_compute_thread(
            _FastDecoder if reason is None else _HFDecoder,  # the fast one converts weights: torch compute
            self.model,
            max_batch_size,
            *((self.max_seq_len,) if reason is None else ()),
            matmul_dtype=matmul_dtype,
            **({"native_kernels": native_kernels, "session_cache_mb": session_cache_mb} if reason is None else {}),
        )
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._params = dict(self.model.state_dict(keep_vars=True))  # HF name -> live tensor, tied names included

        self._waiting: deque[_Request] = deque()
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
        if isinstance(self._decoder, _FastDecoder):
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
            _Request(list(prompt), params, stop_ids, loop.create_future(), session=key, stop_text=stop_text)
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

    def _admit(self) -> list[_Request]:
        """Waiting requests for the free slots, stamped with the version that will generate them."""
        admitted: list[_Request] = []
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
