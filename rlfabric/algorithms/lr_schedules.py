"""GRPO's learning-rate schedules (``grpo.lr_schedule``), registered by name in ``rlfabric.objectives``.

A schedule is its shape alone, ``fn(done) -> factor of grpo.lr``, with ``done`` = (t - W) / (T - W) in [0, 1] the
fraction of the decay behind GRPO step t (0-based) of a run of T steps after W warm-up steps; ``scheduled_lr``
adds the warm-up and the clamp, once for every shape. Pure Python, no torch: the driver calls it once a step.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def scheduled_lr(shape: Callable[[float], float], lr: float, step: int, total_steps: int, warmup_steps: int) -> float:
    """lr_t = lr * (t + 1) / W during the warm-up (t < W), then lr * shape(min((t - W) / (T - W), 1))."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    return lr * shape(min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0))


def constant_lr(done: float) -> float:
    """factor = 1: lr throughout."""
    return 1.0


def linear_lr(done: float) -> float:
    """factor = 1 - done: lr at the first step after the warm-up, lr / (T - W) at the last (t = T - 1), 0 only past
    the end (Hugging Face's "linear" schedule)."""
    return 1.0 - done


def cosine_lr(done: float) -> float:
    """factor = (1 + cos(pi * done)) / 2: lr after the warm-up, near 0 at the last step (Hugging Face's "cosine"
    schedule, half a period)."""
    return (1.0 + math.cos(math.pi * done)) / 2.0
