"""The built-in text tasks (``task:arithmetic``, ``task:countdown``), for envs and benchmarks.

They live in ``rlfabric.tasks``, in the data layer beside ``rlfabric.data`` that reads the ``TASKS`` table: a new
task is a ``rows(n, seed, **options)`` generator added there. This module re-exports them under their old names.
"""

from rlfabric.tasks import (
    ARITHMETIC_OPS,
    COUNTDOWN_OPS,
    TASKS,
    TEACHER_SAMPLES,
    arithmetic_rows,
    countdown_rows,
)

__all__ = ["ARITHMETIC_OPS", "COUNTDOWN_OPS", "TASKS", "TEACHER_SAMPLES", "arithmetic_rows", "countdown_rows"]
