"""Native CPU kernels for the torch engine's decode step, compiled on first use and loaded through ctypes.

One kernel so far, ``kernels/decode_attention.c``: a float32 decode step's RoPE, KV-cache write and attention for
one layer, in one pass (``DecodeKernels.attention``). The torch ops it replaces spend most of their time in per-op
and per-(slot, head) overhead rather than in reading the cache; on two cores the kernel makes a generation of the
benchmark batch about 1.3x faster (benchmarks/RESULTS.md). Fusing the norms and SwiGLU the same way was measured
and dropped: torch's vectorised kernels for those are already within a few microseconds of a native loop.

The library is built with the machine's C compiler (``$CC``, else ``cc`` or ``gcc``) for this CPU
(``-march=native``) into a cache directory (``$RLFABRIC_KERNEL_CACHE``, else ``~/.cache/rlfabric/kernels``), keyed by
the source, the flags, the compiler and the CPU, so each machine builds once (about a second). It links the OpenMP
runtime torch has already loaded, so kernel and torch share one thread team (two teams on the same cores make every
small kernel pay a thread wake-up). Where any of that is missing (no compiler, torch not on GNU OpenMP, not Linux,
``RLFABRIC_NATIVE_KERNELS=0``) the engine uses its torch path, which gives the same numbers; ``unavailable_reason``
says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "kernels" / "decode_attention.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
MAX_HEAD_DIM = 512  # the kernel's per-head buffers (MAX_DIM in the C file)
BUILD_TIMEOUT_S = 120


class NativeKernelError(RuntimeError):
    """A native kernel could not be built or loaded; the message says why."""


class DecodeKernels:
    """The kernels of ``kernels/decode_attention.c`` behind checks: every pointer they are given must hold what they
    read and write, since C does not check."""

    def __init__(self, library: ctypes.CDLL) -> None:
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._attention = library.rlf_decode_attention_f32
        self._attention.argtypes = [i64, i64, i64, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, f32, ptr]
        self._attention.restype = ctypes.c_int

    def attention(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        positions: torch.Tensor,
        max_position: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """RoPE on ``qk`` [n, (heads + kv_heads) * dim]'s q and k at ``positions`` [n] (largest ``max_position``),
        k and ``v`` [n, kv_heads * dim] into the caches [slots, kv_heads, capacity, dim] at those positions, then
        ``out`` [n, heads * dim] = each q's attention over its slot's rows 0..position. Returns ``out``."""
        n = len(positions)
        _, kv_heads, capacity, dim = k_cache.shape
        heads = out.shape[1] // dim
        if not all(
            t.dtype == torch.float32 and t.device.type == "cpu" for t in (qk, v, cos, signed_sin, k_cache, v_cache, out)
        ):
            raise TypeError("attention kernel: every tensor must be float32 on CPU")
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            raise TypeError("attention kernel: positions must be contiguous int64")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()):
            raise ValueError("attention kernel: the caches and out must be contiguous")
        if not (cos.is_contiguous() and signed_sin.is_contiguous() and cos.shape == signed_sin.shape):
            raise ValueError("attention kernel: cos and signed_sin must be contiguous, of one shape")
        if qk.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("attention kernel: qk and v rows must be contiguous")
        if (
            v_cache.shape != k_cache.shape
            or len(k_cache) < n
            or qk.shape != (n, (heads + kv_heads) * dim)
            or v.shape != (n, kv_heads * dim)
            or out.shape != (n, heads * dim)
            or heads % kv_heads
            or cos.shape[1] != dim
            or dim > MAX_HEAD_DIM
        ):
            raise ValueError(
                f"attention kernel: shapes do not fit: qk {tuple(qk.shape)}, v {tuple(v.shape)}, "
                f"cache {tuple(k_cache.shape)}, out {tuple(out.shape)}, rope table {tuple(cos.shape)}"
            )
        if not 0 <= max_position < min(capacity, len(cos)):
            raise ValueError(
                f"attention kernel: position {max_position} outside the cache ({capacity}) or rope table ({len(cos)})"
            )
        status = self._attention(
            n, heads, kv_heads, dim, qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0),
            cos.data_ptr(), signed_sin.data_ptr(), positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            capacity, scale, out.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("attention kernel: could not allocate its score buffer")
        return out


def disabled_by_env() -> bool:
    return os.environ.get("RLFABRIC_NATIVE_KERNELS", "1").strip().lower() in ("0", "false", "no", "off")


def openmp_runtime_problem() -> str | None:
    """None when torch runs on GNU OpenMP and has loaded it, so a ``-fopenmp`` library shares its runtime."""
    if platform.system() != "Linux":
        return f"native kernels are built for Linux only (this is {platform.system()})"
    if "OpenMP" not in torch.__config__.parallel_info():
        return "torch's CPU parallel backend is not OpenMP"
    with open("/proc/self/maps") as maps:
        if "libgomp" not in maps.read():
            return "torch does not use GNU OpenMP (libgomp), which the kernel links"
    return None


def find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def cache_dir() -> Path:
    """``$RLFABRIC_KERNEL_CACHE``, else ``~/.cache/rlfabric/kernels``; a private temporary folder where neither
    can be written (a read-only home in a container, say)."""
    configured = os.environ.get("RLFABRIC_KERNEL_CACHE")
    if configured:
        return Path(configured)
    home_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlfabric" / "kernels"
    try:
        home_cache.mkdir(parents=True, exist_ok=True)
        if os.access(home_cache, os.W_OK):
            return home_cache
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"rlfabric-kernels-{os.getuid()}"


def _cpu_identity() -> str:
    """The CPU's model and feature flags: a library built with -march=native is only valid for those."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def build_library(source: Path, compiler: str, directory: Path) -> Path:
    """Compile ``source`` into a shared library in ``directory`` (unless an identical build is there already)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        "\0".join([source.read_text(), " ".join(FLAGS), version, _cpu_identity(), platform.machine()]).encode()
    ).hexdigest()[:16]
    target = directory / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Build to a private name and rename: actors starting together may build at once.
    fd, partial = tempfile.mkstemp(dir=directory, prefix=f".{source.stem}-", suffix=".so")
    os.close(fd)
    try:
        command = [compiler, *FLAGS, str(source), "-o", partial, "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise NativeKernelError(f"{compiler} failed to build {source.name}: {result.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


@functools.cache
def _load_decode_kernels() -> DecodeKernels | str:
    problem = openmp_runtime_problem()
    if problem:
        return problem
    compiler = find_compiler()
    if compiler is None:
        return "no C compiler found (set CC, or install gcc)"
    try:
        return DecodeKernels(ctypes.CDLL(str(build_library(SOURCE, compiler, cache_dir()))))
    except (OSError, subprocess.SubprocessError, NativeKernelError) as error:
        reason = f"could not build the native decode kernels: {error}"
        log.warning("rlfabric: %s; the torch engine uses its torch path instead (same results, slower)", reason)
        return reason


def decode_kernels() -> DecodeKernels | None:
    """The kernels, built and loaded once per process; None where they are unavailable (``unavailable_reason``)."""
    loaded = None if disabled_by_env() else _load_decode_kernels()
    return loaded if isinstance(loaded, DecodeKernels) else None


def unavailable_reason() -> str | None:
    """Why ``decode_kernels`` is None, or None when they are available."""
    if disabled_by_env():
        return "RLFABRIC_NATIVE_KERNELS=0"
    loaded = _load_decode_kernels()
    return loaded if isinstance(loaded, str) else None
