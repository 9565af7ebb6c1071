"""GRPO's learning-rate schedules (``grpo.lr_schedule``), registered by name in ``rlfabric.objectives``.

Each is ``fn(lr, step, total_steps, warmup_steps) -> learning rate`` for GRPO step ``step`` (0-based) of a run of
``total_steps`` steps: first ``warmup_steps`` steps of linear warm-up, lr * (t + 1) / W, then the schedule's own
shape over the remaining T - W steps. Pure Python, no torch: the driver calls it once a step.
"""

from __future__ import annotations

import math


def _warmup_or_progress(lr: float, step: int, total_steps: int, warmup_steps: int) -> tuple[float | None, float]:
    """(the warm-up learning rate, or None past warm-up; the fraction (t - W) / (T - W) of the decay done)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps, 0.0
    return None, (step - warmup_steps) / max(total_steps - warmup_steps, 1)


def constant_lr(lr: float, step: int, total_steps: int, warmup_steps: int) -> float:
    """lr_t = lr for t >= W (after the warm-up)."""
    warm, _ = _warmup_or_progress(lr, step, total_steps, warmup_steps)
    return lr if warm is None else warm


def linear_lr(lr: float, step: int, total_steps: int, warmup_steps: int) -> float:
    """lr_t = lr * (1 - (t - W) / (T - W)) for t >= W: lr at the first step after the warm-up, lr / (T - W) at
    the last (t = T - 1), 0 only past the end (Hugging Face's "linear" schedule)."""
    warm, done = _warmup_or_progress(lr, step, total_steps, warmup_steps)
    return lr * max(1.0 - done, 0.0) if warm is None else warm


def cosine_lr(lr: float, step: int, total_steps: int, warmup_steps: int) -> float:
    """lr_t = lr * (1 + cos(pi * (t - W) / (T - W))) / 2 for t >= W: lr after the warm-up, near 0 at the last step
    (Hugging Face's "cosine" schedule, half a period)."""
    warm, done = _warmup_or_progress(lr, step, total_steps, warmup_steps)
    return lr * (1.0 + math.cos(math.pi * min(done, 1.0))) / 2.0 if warm is None else warm
