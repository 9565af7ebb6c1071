"""Slots of interchangeable actors of one role, replaced by generation when they fail.

The one fault mechanism for every role: env runners (``RunnerPool``), reward services (``RewardPool``),
generators and rollout workers (the LLM driver). Every piece of work is handed out with the (slot, generation) of
the actor doing it; a failure report names both. ``replace`` starts a fresh
actor in the slot only when the report is about the slot's current generation, so several reports about one dead
actor (a late reply, or two requests in flight on it) replace it once. A slot that fails too often in a row with
no success in between is a bug, not bad luck: the run stops with its last error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

MAX_CONSECUTIVE_FAILURES = 5


def error_summary(exc: BaseException) -> str:
    """The last line of an exception's text (for a remote error: the original exception), at most 300 chars."""
    text = str(exc).strip()
    return text.splitlines()[-1][:300] if text else exc.__class__.__name__


class RunAbortedError(RuntimeError):
    """The run cannot go on: an actor slot keeps failing with the same bug, or nothing can be trained."""


class ActorSlots:
    def __init__(
        self,
        role: str,
        make: Callable[[int, int], Any],
        count: int,
        max_consecutive_failures: int = MAX_CONSECUTIVE_FAILURES,
    ) -> None:
        """``make(slot, generation)`` starts the actor for a slot; ``role`` names it in notes and errors."""
        self.role, self.make = role, make
        self.max_consecutive_failures = max_consecutive_failures
        self.generations = [0] * count
        self.handles = [make(i, 0) for i in range(count)]
        self.consecutive_failures = [0] * count
        self.restarts = 0

    def __len__(self) -> int:
        return len(self.handles)

    def entries(self) -> list[tuple[int, int, Any]]:
        """(slot, generation, handle) of every slot, as work is handed out with them."""
        return [(i, self.generations[i], h) for i, h in enumerate(self.handles)]

    def succeeded(self, slot: int, generation: int) -> None:
        """Work of ``slot``'s ``generation`` came back: its run of failures is over."""
        if generation == self.generations[slot]:
            self.consecutive_failures[slot] = 0

    def replace(self, slot: int, generation: int, reason: str, failure: bool = True) -> bool:
        """Kill and restart ``slot`` if ``generation`` is still its current one; False when it already was
        replaced (the report is about an actor that is gone). Raises RunAbortedError past the failure limit;
        ``failure=False`` replaces an actor that did its work but cannot be reused, which does not count."""
        if generation != self.generations[slot]:
            return False
        self.consecutive_failures[slot] += int(failure)
        if self.consecutive_failures[slot] > self.max_consecutive_failures:
            raise RunAbortedError(
                f"{self.role} {slot} failed {self.consecutive_failures[slot]} times in a row; last: {reason}"
            )
        ray.kill(self.handles[slot], no_restart=True)
        self.generations[slot] += 1
        self.handles[slot] = self.make(slot, self.generations[slot])
        self.restarts += 1
        return True

    def shutdown(self) -> None:
        for handle in self.handles:
            ray.kill(handle, no_restart=True)
        self.handles = []
