"""The driver's view of its env runners: launch, sample with a deadline, replace the dead or hung.

The pool hands out ObjectRefs only; fragment data never passes through the driver. A runner whose sample raises
(its process died) or misses ``sample_timeout_s`` (a hung env) is killed and replaced by a fresh actor with the
current weights; its fragment is counted as lost and the driver simply asks again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayError

from rlfabric.actor_slots import MAX_CONSECUTIVE_FAILURES, ActorSlots, RunAbortedError, error_summary

__all__ = ["MAX_CONSECUTIVE_FAILURES", "Completed", "RunAbortedError", "RunnerPool", "error_summary"]


@dataclass
class InFlight:
    runner: int
    generation: int  # the runner slot's generation when the sample was asked for
    meta_ref: ray.ObjectRef
    data_ref: ray.ObjectRef
    deadline: float


@dataclass
class Completed:
    runner: int
    meta: dict[str, Any]
    data_ref: ray.ObjectRef


class RunnerPool:
    def __init__(self, make_runner: Callable[[int, int], Any], num_runners: int, sample_timeout_s: float) -> None:
        """``make_runner(index, generation)`` creates the actor; generation counts replacements of that slot."""
        self.sample_timeout_s = sample_timeout_s
        self.slots = ActorSlots("runner", make_runner, num_runners)
        self.in_flight: dict[ray.ObjectRef, InFlight] = {}
        self.weights_ref: ray.ObjectRef | None = None
        self.lost_fragments = 0
        self.failures: list[str] = []

    @property
    def runners(self) -> list[Any]:
        return self.slots.handles

    @property
    def restarts(self) -> int:
        return self.slots.restarts

    def __len__(self) -> int:
        return len(self.runners)

    def call(self, index: int, method: str, *args: Any, timeout: float | None = None) -> Any:
        """A blocking call on one runner (setup and evaluation, not the hot path)."""
        return ray.get(getattr(self.runners[index], method).remote(*args), timeout=timeout)

    def broadcast(self, weights_ref: ray.ObjectRef) -> None:
        """Send one published version to every runner: each reads the same object from the store."""
        self.weights_ref = weights_ref
        for runner in self.runners:
            runner.set_weights.remote(weights_ref)

    def busy(self, index: int) -> bool:
        return any(f.runner == index for f in self.in_flight.values())

    def submit(self, index: int) -> None:
        meta_ref, data_ref = self.runners[index].sample.remote()
        deadline = time.monotonic() + self.sample_timeout_s
        self.in_flight[meta_ref] = InFlight(index, self.slots.generations[index], meta_ref, data_ref, deadline)

    def pending_refs(self) -> list[ray.ObjectRef]:
        return list(self.in_flight)

    def collect(self, ready: list[ray.ObjectRef]) -> tuple[list[Completed], list[int]]:
        """Turn ready metadata refs into completed fragments; replace runners that failed or overran.

        Returns (completed fragments, indices of runners that were replaced and owe their fragment again).
        """
        done: list[Completed] = []
        failed: list[int] = []
        for ref in ready:
            flight = self.in_flight.pop(ref, None)
            if flight is None:
                continue
            try:
                meta = ray.get(flight.meta_ref, timeout=0)
            except RayError as exc:  # the process died, or the env raised inside sample()
                self._discard(flight.data_ref)
                self._replace(flight, f"runner {flight.runner} failed: {exc.__class__.__name__}: {error_summary(exc)}")
                failed.append(flight.runner)
                continue
            self.slots.succeeded(flight.runner, flight.generation)
            done.append(Completed(flight.runner, meta, flight.data_ref))
        now = time.monotonic()
        for ref, flight in list(self.in_flight.items()):
            if now > flight.deadline and not ray.wait([ref], timeout=0)[0]:  # finished in time but not yet read
                del self.in_flight[ref]
                self._discard(flight.data_ref)
                self._replace(flight, f"runner {flight.runner} missed its {self.sample_timeout_s:g}s deadline")
                failed.append(flight.runner)
        return done, failed

    @staticmethod
    def _discard(ref: ray.ObjectRef) -> None:
        """Give up on a sample's result; a failed one is read once so Ray does not log its error as unhandled."""
        if ray.wait([ref], timeout=0)[0]:
            try:
                ray.get(ref, timeout=0)
            except RayError:
                pass

    def _replace(self, flight: InFlight, reason: str) -> None:
        """Replace the runner a failed sample ran on (once per runner) and count its fragment as lost."""
        self.failures.append(reason)
        if self.slots.replace(flight.runner, flight.generation, reason) and self.weights_ref is not None:
            self.runners[flight.runner].set_weights.remote(self.weights_ref)
        self.lost_fragments += 1

    def shutdown(self) -> None:
        self.slots.shutdown()
        # Samples still running when the run ended now fail; read them so Ray does not report them as unhandled.
        refs = [r for f in self.in_flight.values() for r in (f.meta_ref, f.data_ref)]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=5)
        for ref in refs:
            self._discard(ref)
        self.in_flight.clear()
