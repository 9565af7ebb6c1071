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


def error_summary(exc: BaseException) -> str:
    """The last line of an exception's text (for a remote error: the original exception), at most 300 chars."""
    text = str(exc).strip()
    return text.splitlines()[-1][:300] if text else exc.__class__.__name__


class RunAbortedError(RuntimeError):
    """Sampling cannot go on: a runner slot keeps failing with the same bug."""


# A slot that keeps failing with nothing in between is a bug in the env, not bad luck: stop with its error.
MAX_CONSECUTIVE_FAILURES = 5


@dataclass
class InFlight:
    runner: int
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
        self.make_runner = make_runner
        self.sample_timeout_s = sample_timeout_s
        self.generations = [0] * num_runners
        self.runners = [make_runner(i, 0) for i in range(num_runners)]
        self.in_flight: dict[ray.ObjectRef, InFlight] = {}
        self.weights_ref: ray.ObjectRef | None = None
        self.restarts = 0
        self.lost_fragments = 0
        self.failures: list[str] = []
        self.consecutive_failures = [0] * num_runners

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
        self.in_flight[meta_ref] = InFlight(index, meta_ref, data_ref, time.monotonic() + self.sample_timeout_s)

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
                self._replace(
                    flight.runner, f"runner {flight.runner} failed: {exc.__class__.__name__}: {error_summary(exc)}"
                )
                failed.append(flight.runner)
                continue
            self.consecutive_failures[flight.runner] = 0
            done.append(Completed(flight.runner, meta, flight.data_ref))
        now = time.monotonic()
        for ref, flight in list(self.in_flight.items()):
            if now > flight.deadline and not ray.wait([ref], timeout=0)[0]:  # finished in time but not yet read
                del self.in_flight[ref]
                self._discard(flight.data_ref)
                self._replace(flight.runner, f"runner {flight.runner} missed its {self.sample_timeout_s:g}s deadline")
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

    def _replace(self, index: int, reason: str) -> None:
        self.failures.append(reason)
        self.consecutive_failures[index] += 1
        if self.consecutive_failures[index] > MAX_CONSECUTIVE_FAILURES:
            raise RunAbortedError(
                f"runner {index} failed {self.consecutive_failures[index]} times in a row; last: {reason}"
            )
        ray.kill(self.runners[index], no_restart=True)
        self.generations[index] += 1
        self.runners[index] = self.make_runner(index, self.generations[index])
        if self.weights_ref is not None:
            self.runners[index].set_weights.remote(self.weights_ref)
        self.restarts += 1
        self.lost_fragments += 1

    def shutdown(self) -> None:
        for runner in self.runners:
            ray.kill(runner, no_restart=True)
        # Samples still running when the run ended now fail; read them so Ray does not report them as unhandled.
        refs = [r for f in self.in_flight.values() for r in (f.meta_ref, f.data_ref)]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=5)
        for ref in refs:
            self._discard(ref)
        self.in_flight.clear()
