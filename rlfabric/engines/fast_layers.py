"""The fast decoder's layer pieces (``rlfabric.engines.fast_decoder``): one decoder layer's weights
(``LayerParams``: norms by reference, projections in the matmul dtype, stacked and oneDNN-packed where that pays)
and the ops of its forward (RMSNorm, RoPE, the q/k/v and output projections, the SwiGLU MLP), computed as
transformers computes them for the Llama, Qwen2 and Mistral families.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


def attention_linears(layer: nn.Module) -> tuple[nn.Linear, ...]:
    a = layer.self_attn
    return a.q_proj, a.k_proj, a.v_proj, a.o_proj


def mlp_linears(layer: nn.Module) -> tuple[nn.Linear, ...]:
    m = layer.mlp
    return m.gate_proj, m.up_proj, m.down_proj


class Norm(NamedTuple):
    weight: torch.Tensor
    eps: float


class Linear:
    """A projection for the fast path: weight and bias in the matmul dtype, plus, on CPU, the weight prepacked
    into oneDNN's blocked layout (``packed``), which multiplies the small decode batches 1.3x-1.5x faster than
    ``F.linear`` (benchmarks/RESULTS.md). The pack is a copy: ``repack`` re-makes it after every weight load."""

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.packed: torch.Tensor | None = None

    @classmethod
    def of(cls, modules: tuple[nn.Linear, ...], dtype: torch.dtype, copies: list[Copy]) -> Linear:
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
                copies.append(Copy(out[start : start + len(t)], t))
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


class Copy(NamedTuple):
    """A decoder-owned copy of (part of) a parameter: ``destination.copy_(source)`` brings it up to date."""

    destination: torch.Tensor
    source: torch.Tensor


class LayerParams(NamedTuple):
    """One decoder layer's weights: norms by reference, projections in the decoder's matmul dtype.

    ``attn_in`` (q, k, v) and ``mlp_in`` (gate, up) are each one stacked projection or one per module (see
    ``_projections``).
    """

    attn_norm: Norm
    attn_in: tuple[Linear, ...]
    qk_dim: int  # width of q and k together: where v starts in a stacked projection's output
    o: Linear
    mlp_norm: Norm
    mlp_in: tuple[Linear, ...]
    down: Linear

    @classmethod
    def of(cls, layer: nn.Module, matmul_dtype: torch.dtype, copies: list[Copy]) -> LayerParams:
        q, k, v, o = attention_linears(layer)
        gate, up, down = mlp_linears(layer)
        return cls(
            Norm(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
            _projections((q, k, v), matmul_dtype, copies),
            q.out_features + k.out_features,
            Linear.of((o,), matmul_dtype, copies),
            Norm(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
            _projections((gate, up), matmul_dtype, copies),
            Linear.of((down,), matmul_dtype, copies),
        )


def _projections(modules: tuple[nn.Linear, ...], dtype: torch.dtype, copies: list[Copy]) -> tuple[Linear, ...]:
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
        return (Linear.of(modules, dtype, copies),)
    return tuple(Linear.of((m,), dtype, copies) for m in modules)


def rms_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    """Transformers' RMSNorm: normalise in float32, cast back, then scale (in that order, so outputs match).

    One fused kernel instead of transformers' six elementwise ops: per-op overhead is a large share of a decode
    step on small models.
    """
    if x.dtype == torch.float32:  # no casts, so the scaling can join the kernel
        return F.rms_norm(x, x.shape[-1:], norm.weight, norm.eps)
    return norm.weight * F.rms_norm(x.float(), x.shape[-1:], eps=norm.eps).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it: ``x * cos + rotate_half(x) * sin``, rotate_half(x) being
    (-x2, x1). Here the minus lives in the table (``signed_sin`` = (-sin1, sin2), see
    ``FastDecoder._rope_table`` in ``rlfabric.engines.fast_decoder``), so this is (x2, x1) * signed_sin: a kernel
    fewer, the same numbers in every dtype (negation is exact)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin


def mlp(x: torch.Tensor, p: LayerParams) -> torch.Tensor:
    """SwiGLU in the matmul dtype."""
    x = x.to(p.down.weight.dtype)
    if len(p.mlp_in) == 1:
        gate, up = p.mlp_in[0](x).chunk(2, dim=-1)
    else:
        gate, up = (m(x) for m in p.mlp_in)
    return p.down(F.silu(gate) * up)


def project_qkv(h: torch.Tensor, p: LayerParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(q and k side by side [..., qk_dim], v), computed in the matmul dtype, returned in the activations' dtype.

    q and k come together because RoPE then runs once for both; from a stacked projection both parts are views.
    """
    h_mm = h.to(p.o.weight.dtype)
    outs = [m(h_mm).to(h.dtype) for m in p.attn_in]
    if len(outs) == 1:
        return outs[0][..., : p.qk_dim], outs[0][..., p.qk_dim :]
    return torch.cat(outs[:2], dim=-1), outs[2]


def out_proj(out: torch.Tensor, p: LayerParams) -> torch.Tensor:
    return p.o(out.to(p.o.weight.dtype))
