"""The native decode attention kernel against the torch ops it replaces, and how it is built and turned off."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from rlfabric.engines import native
from rlfabric.engines.base import SamplingParams
from rlfabric.engines.torch_engine import TorchEngine
from rlfabric.models.hf import build_char_tokenizer, build_small_qwen2

needs_compiler = pytest.mark.skipif(native.find_compiler() is None, reason="no C compiler on this machine")


def rope_tables(length: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(length)[:, None] * (10000.0 ** (-torch.arange(0, dim, 2) / dim))[None]
    angles = torch.cat((angles, angles), dim=-1)
    half = dim // 2
    sin = angles.sin()
    return angles.cos(), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def reference(qk, v, cos, signed_sin, positions, k_cache, v_cache, heads, scale):
    """RoPE, cache writes and masked attention in plain torch: what the kernel must compute."""
    n, (_, kv_heads, _, dim) = len(positions), k_cache.shape
    qk = qk.reshape(n, heads + kv_heads, dim)
    rotated = (
        qk * cos[positions][:, None]
        + torch.cat((qk[..., dim // 2 :], qk[..., : dim // 2]), -1) * signed_sin[positions][:, None]
    )
    q, k = rotated[:, :heads], rotated[:, heads:]
    for b, pos in enumerate(positions.tolist()):
        k_cache[b, :, pos] = k[b]
        v_cache[b, :, pos] = v.reshape(n, kv_heads, dim)[b]
    span = int(positions.max()) + 1
    mask = torch.arange(span)[None] > positions[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None],
        k_cache[:n, :, :span],
        v_cache[:n, :, :span],
        attn_mask=~mask[:, None, None],
        scale=scale,
        enable_gqa=heads != kv_heads,
    )
    return out.reshape(n, heads * dim)


@needs_compiler
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "capacity"),
    [(4, 4, 64, 48), (4, 2, 32, 40), (6, 1, 16, 24), (2, 2, 8, 1500)],  # MHA, GQA, MQA, scores past the stack
)
def test_kernel_matches_torch_ops(heads, kv_heads, dim, capacity):
    kernels = native.decode_kernels()
    assert kernels is not None, native.unavailable_reason()
    torch.manual_seed(0)
    n, slots = 5, 7
    positions = torch.tensor([0, 3, capacity - 1, 11, 2])
    # q/k/v as views into one stacked projection output, as the engine's stacked q|k|v matmul gives them
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim)
    qk, v = qkv[:, : (heads + kv_heads) * dim], qkv[:, (heads + kv_heads) * dim :]
    cos, signed_sin = rope_tables(capacity, dim)
    caches = torch.randn(2, slots, kv_heads, capacity, dim)
    expected_caches = caches.clone()
    expected = reference(qk, v, cos, signed_sin, positions, *expected_caches, heads, dim**-0.5)

    out = torch.full((n, heads * dim), float("nan"))
    k_cache, v_cache = caches
    kernels.attention(qk, v, cos, signed_sin, positions, int(positions.max()), k_cache, v_cache, dim**-0.5, out)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches, expected_caches, atol=1e-6, rtol=1e-6)  # written rows, and nothing else


@needs_compiler
def test_kernels_refuse_what_they_cannot_read_safely():
    kernels = native.decode_kernels()
    assert kernels is not None, native.unavailable_reason()
    kernel = kernels.attention
    heads, dim, capacity = 2, 8, 16
    cos, signed_sin = rope_tables(capacity, dim)
    k_cache, v_cache = torch.zeros(2, 3, heads, capacity, dim)
    qk, v, out = torch.zeros(3, 2 * heads * dim), torch.zeros(3, heads * dim), torch.zeros(3, heads * dim)
    positions = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="position 16 outside the cache"):
        kernel(qk, v, cos, signed_sin, positions, 16, k_cache, v_cache, 1.0, out)
    with pytest.raises(TypeError, match="float32"):
        kernel(qk.double(), v, cos, signed_sin, positions, 3, k_cache, v_cache, 1.0, out)
    with pytest.raises(ValueError, match="shapes do not fit"):
        kernel(qk[:2], v, cos, signed_sin, positions, 3, k_cache, v_cache, 1.0, out)
    with pytest.raises(TypeError, match="int64"):
        kernel(qk, v, cos, signed_sin, positions.int(), 3, k_cache, v_cache, 1.0, out)


@needs_compiler
def test_a_build_error_names_the_compiler_and_its_message(tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return missing_name; }\n")
    with pytest.raises(native.NativeKernelError, match="missing_name"):
        native.build_library(broken, native.find_compiler(), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.so")), "a failed build leaves no library behind"


@needs_compiler
def test_builds_once_per_source_and_machine(tmp_path):
    compiler = native.find_compiler()
    first = native.build_library(native.SOURCE, compiler, tmp_path)
    built_at = first.stat().st_mtime_ns
    assert native.build_library(native.SOURCE, compiler, tmp_path) == first
    assert first.stat().st_mtime_ns == built_at
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial files left


def _torch_on_gnu_openmp() -> bool:
    """This machine's facts, read here rather than asked of ``native``: Linux, and torch running on libgomp."""
    if platform.system() != "Linux" or "OpenMP" not in torch.__config__.parallel_info():
        return False
    with open("/proc/self/maps") as maps:
        return "libgomp" in maps.read()


HAS_COMPILER = any(shutil.which(name) for name in (os.environ.get("CC"), "cc", "gcc") if name)
ENGINE_ATTENTION = """
import json, sys
from rlfabric.engines.torch_engine import TorchEngine
from rlfabric.models.hf import build_char_tokenizer, build_small_qwen2
model = build_small_qwen2(build_char_tokenizer(), num_layers=1, hidden_size=32, num_heads=2)
print(json.dumps([TorchEngine(model, []).attention, TorchEngine(model, [], matmul_dtype="bfloat16").attention]))
"""


def _attention_in_fresh_process(env: dict[str, str]) -> list[str]:
    """What a TorchEngine says about its attention in a new process (the kernels are loaded once per process)."""
    out = subprocess.run([sys.executable, "-c", ENGINE_ATTENTION], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_says_which_attention_decodes(monkeypatch):
    tokenizer = build_char_tokenizer()
    model = build_small_qwen2(tokenizer, num_layers=1, hidden_size=32, num_heads=2)
    assert TorchEngine(model, [], native_kernels=False).attention == "torch attention (native_kernels=False)"
    monkeypatch.setenv("RLFABRIC_NATIVE_KERNELS", "0")
    assert native.decode_kernels() is None
    assert TorchEngine(model, []).attention == "torch attention (RLFABRIC_NATIVE_KERNELS=0)"


@pytest.mark.skipif(not (HAS_COMPILER and _torch_on_gnu_openmp()), reason="needs a C compiler and torch on libgomp")
def test_where_a_compiler_and_gnu_openmp_are_the_engine_decodes_with_the_native_kernel(tmp_path):
    """On a machine with a C compiler on PATH and torch on libgomp, a fresh process builds the kernel into an empty
    cache and the engine uses it, in float32 and bfloat16 matmuls alike (attention stays float32)."""
    env = {**os.environ, "RLFABRIC_KERNEL_CACHE": str(tmp_path / "kernels")}
    env.pop("RLFABRIC_NATIVE_KERNELS", None)
    assert _attention_in_fresh_process(env) == ["native decode attention"] * 2
    assert len(list((tmp_path / "kernels").glob("decode_attention-*.so"))) == 1  # built here, not found elsewhere


@pytest.mark.skipif(not _torch_on_gnu_openmp(), reason="the compiler is only looked for where torch runs on libgomp")
def test_without_a_compiler_the_engine_decodes_with_torch_ops_and_says_why(tmp_path):
    """CC naming a compiler that does not exist, no cc or gcc on PATH, and nothing built before: the engine falls
    back to its torch path and names the reason."""
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "PATH": str(empty_bin)}
    env["RLFABRIC_KERNEL_CACHE"] = str(tmp_path / "kernels")  # empty: no library built by an earlier run
    env.pop("RLFABRIC_NATIVE_KERNELS", None)
    expected = "torch attention (no C compiler found (set CC, or install gcc))"
    assert _attention_in_fresh_process(env) == [expected] * 2
    assert not (tmp_path / "kernels").exists() or not list((tmp_path / "kernels").iterdir())


def test_engine_falls_back_to_torch_ops_when_the_kernel_refuses_a_layout():
    """A layout the kernel's checks refuse mid-run costs no request: the step is redone in torch ops, for good."""
    tokenizer = build_char_tokenizer()
    model = build_small_qwen2(tokenizer, num_layers=2, hidden_size=64, num_heads=4)
    prompts = [tokenizer("1+2=").input_ids, tokenizer("hello").input_ids]

    class Refusing:
        calls = 0

        def attention(self, *args, **kwargs):
            Refusing.calls += 1
            raise ValueError("attention kernel: shapes do not fit (test)")

    def greedy(engine: TorchEngine) -> list[list[int]]:
        params = SamplingParams(max_new_tokens=8, temperature=0)
        return [c.token_ids for c in asyncio.run(engine.generate(prompts, params))]

    expected = greedy(TorchEngine(model, [], native_kernels=False))
    engine = TorchEngine(model, [])
    engine._decoder.native = Refusing()
    assert greedy(engine) == expected
    assert Refusing.calls == 1 and "the native kernel refused" in engine.attention
