"""The torch engine's fast decoder (Llama, Qwen2 and Mistral families): continuous batching over a slot KV cache.

The decoder forward is written out here over a preallocated slot KV cache ``[layers, slots, kv_heads, length,
head_dim]``. It reads the weights straight from the Hugging Face module's parameters (or, with ``matmul_dtype``
set, from copies of the projections in that dtype, re-made at every weight update; see
``rlfabric.engines.fast_layers``). Transformers' ``generate`` spends much of its time on per-step plumbing (mask
building, cache concatenation, logits processors) rather than matmuls; this path skips that. Models it cannot serve
(``fast_path_unsupported_reason``) take ``rlfabric.engines.hf_decoder`` instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rlfabric.engines import native
from rlfabric.engines.fast_layers import (
    Copy,
    LayerParams,
    Linear,
    Norm,
    attention_linears,
    mlp,
    mlp_linears,
    out_proj,
    project_qkv,
    rms_norm,
    rope,
)
from rlfabric.engines.requests import EngineRequest
from rlfabric.engines.sampling import sample_tokens
from rlfabric.engines.session_cache import CachedPrefix, SessionCache
from rlfabric.models.hf import STATIC_ROPE_TYPES  # the others rescale with the sequence: they take the fallback

log = logging.getLogger(__name__)
# attend(layer index, qk, v) -> attention output [n, heads * head_dim], for one decode step
DecodeAttentionStep = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]

# Model families whose decoder layer is: RMSNorm -> attention (q/k/v/o projections, RoPE, GQA) -> residual ->
# RMSNorm -> SwiGLU MLP -> residual. Their modules share names, so one forward serves all three.
FAST_PATH_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})


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
    linears = [head] + [m for layer in body.layers for m in (*attention_linears(layer), *mlp_linears(layer))]
    if any(type(m) is not nn.Linear for m in linears):  # quantized or otherwise wrapped layers
        return "some projection is not a plain nn.Linear"
    return None


def _runs(values: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal neighbours as ``(start, stop, value)``: ``[4, 4, 7]`` -> ``[(0, 2, 4), (2, 3, 7)]``."""
    runs: list[tuple[int, int, int]] = []
    for i, value in enumerate(values):
        if runs and runs[-1][2] == value:
            runs[-1] = (runs[-1][0], i + 1, value)
        else:
            runs.append((i, i + 1, value))
    return runs


class FastDecoder:
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
        self.copies: list[Copy] = []
        self.layers = [LayerParams.of(layer, self.matmul_dtype, self.copies) for layer in body.layers]
        self.embed = body.embed_tokens.weight
        self.final_norm = Norm(body.norm.weight, body.norm.variance_epsilon)
        # The LM head stays in the model's dtype (logprobs as the learner computes them); tied or untied, the
        # module knows its weight.
        self.head = Linear.of((model.get_output_embeddings(),), self.embed.dtype, self.copies)
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
        self.slots: list[EngineRequest] = []
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
    def running(self) -> list[EngineRequest]:
        return self.slots

    def refresh_weights(self) -> None:
        """Bring the decoder's copies of the projections up to date after an in-place weight update: converted
        copies into the same buffers (no allocation), then the oneDNN packs (see ``Linear``)."""
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

    def step(self, admitted: list[EngineRequest], generator: torch.Generator) -> list[EngineRequest]:
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

    def _take_sessions(
        self, admitted: list[EngineRequest]
    ) -> tuple[list[EngineRequest], list[tuple[EngineRequest, CachedPrefix]]]:
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
        """cos and signed sin (see ``rope``) for positions [0, length), from the model's own rotary module (theta,
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
        return self.head(rms_norm(hidden, self.final_norm))

    def _prefill(self, admitted: list[EngineRequest], first_slot: int) -> torch.Tensor:
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
            qk, v = project_qkv(rms_norm(x, p.attn_norm), p)
            qk = qk.view(batch, width, self.n_heads + self.n_kv_heads, self.head_dim).transpose(1, 2)
            qk = rope(qk, cos, signed_sin)
            q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
            v = v.view(batch, width, self.n_kv_heads, self.head_dim).transpose(1, 2)
            fill(self.k_cache[i], k)
            fill(self.v_cache[i], v)
            out = self._attend(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, width, -1)
            x = x + out_proj(out, p)
            x = x + mlp(rms_norm(x, p.mlp_norm), p)

        self.slots += admitted
        self.lengths += [len(r.prompt) for r in admitted]
        self.pending += [0] * len(admitted)  # set from the sampled tokens
        self.prefill_tokens += sum(lengths)
        last = x[torch.arange(batch, device=self.device), torch.tensor(lengths, device=self.device) - 1]
        logits = self._logits(last)
        return logits if gather is None else logits.index_select(0, gather)

    def _prefill_continued(self, continued: list[tuple[EngineRequest, CachedPrefix]], first_slot: int) -> torch.Tensor:
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
            qk, v = project_qkv(rms_norm(x, p.attn_norm), p)
            qk = rope(qk.view(batch, width, heads + kv_heads, head_dim).transpose(1, 2), cos, signed_sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = v.view(batch, width, kv_heads, head_dim).transpose(1, 2)
            k_cache, v_cache = self.k_cache[i], self.v_cache[i]
            k_cache.view(-1, head_dim).index_copy_(0, rows, k[written])
            v_cache.view(-1, head_dim).index_copy_(0, rows, v[written])
            out = self._attend(q, k_cache[slots, :, :span], v_cache[slots, :, :span], attn_mask=mask)
            x = x + out_proj(out.transpose(1, 2).reshape(batch, width, -1), p)
            x = x + mlp(rms_norm(x, p.mlp_norm), p)

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
            qk, v = project_qkv(rms_norm(x, p.attn_norm), p)
            x += out_proj(attend(i, qk, v), p)
            x += mlp(rms_norm(x, p.mlp_norm), p)

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
            qk = rope(qk.view(n, heads + kv_heads, 1, head_dim), cos, signed_sin)
            q, k = qk[:, :heads], qk[:, heads:]
            k_cache, v_cache = self.k_cache[i], self.v_cache[i]
            k_cache.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim))
            v_cache.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim))
            out = self._attend(q, k_cache[:n, :, :span], v_cache[:n, :, :span], attn_mask=mask)
            return out.view(n, -1)

        return attend
