"""Freed memory kept in the process for the next step, instead of handed back to the kernel and faulted in again.

glibc's malloc returns the top of its heap to the kernel whenever more than its trim threshold is free there, and
the threshold follows the largest block freed so far (twice glibc's adaptive mmap threshold). A training step frees
its activations and gradients at the end and allocates them again at the start of the next, so the heap shrinks
and grows every step, and every page it grows by is a page fault the kernel zero-fills: about 3,000 faults per
learner step on the GRPO benchmark's model, 6-8 ms of system time a step on two cores (benchmarks/RESULTS.md).

``retain_freed_memory`` fixes both thresholds (``mallopt``): blocks under ``MMAP_THRESHOLD`` come from the heap,
and up to ``TRIM_THRESHOLD`` of free heap stays mapped for reuse; larger blocks are mapped and unmapped on their own
as before. It is what PyTorch's CPU performance guide gets by swapping in jemalloc or tcmalloc, without a preload.
The compute actors (learners, generators, reference and scorer actors) call it as they start. Where the process
already chose its allocator (``LD_PRELOAD``, glibc's ``MALLOC_*_`` variables) or is not on glibc, it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's own ceiling for its adaptive threshold (64-bit)
TRIM_THRESHOLD = 256 * 2**20  # free heap kept per arena: a step's activations and gradients, with room to spare
CHOSEN_ELSEWHERE = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD")


def retain_freed_memory() -> bool:
    """Fix glibc's trim and mmap thresholds for this process (see the module docstring); True when they were set,
    False where the allocator is someone else's choice or not glibc's."""
    if any(os.environ.get(name) for name in CHOSEN_ELSEWHERE):
        return False
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    try:
        mallopt = ctypes.CDLL(path).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt, macOS's libc neither)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
