"""Slots of interchangeable actors of one role, replaced by generation when they fail.

The one fault mechanism of the LLM pipeline's actors (generators, rollout workers): every piece of work is handed
out with the (slot, generation) of the actor doing it; a failure report names both. ``replace`` starts a fresh
actor in the slot only when the report is about the slot's current generation, so several reports about one dead
actor (a late reply, or two requests in flight on it) replace it once. A slot that fails too often in a row with
no success in between is a bug, not bad luck: the run stops with its last error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from rlfabric.runner_pool import RunAbortedError

MAX_CONSECUTIVE_FAILURES = 5


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

    def replace(self, slot: int, generation: int, reason: str) -> bool:
        """Kill and restart ``slot`` if ``generation`` is still its current one; False when it already was
        replaced (the report is about an actor that is gone). Raises RunAbortedError past the failure limit."""
        if generation != self.generations[slot]:
            return False
        self.consecutive_failures[slot] += 1
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
