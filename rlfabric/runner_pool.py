"""The driver's view of its env runners: launch, sample with a deadline, replace the dead or hung.

The pool hands out ObjectRefs only; fragment data never passes through the driver. A runner whose sample raises
(its process or its node died, its env raised or returned a NaN) or misses ``sample_timeout_s`` (a hung env) is
killed and replaced by a fresh actor with the current weights; its fragment is counted as lost and the driver simply
asks again. A replacement waits up to ``sample_timeout_s`` for an alive node with the resources a runner asks for,
else the run stops (``PlacementError``). A runner slot that fails too often stops the run with its last error: 6
times in a row, or half of its last 12 samples (``ActorSlots``' rule: an env that fails after more steps than a
fragment has fails every other sample, each replacement's first one succeeding). An error of a
``fatal`` kind (the config and the env disagree, so every runner would fail the same way) stops the run at once
with the error's own line.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError

from rlfabric.actor_slots import (
    FAILURE_WINDOW,
    MAX_CONSECUTIVE_FAILURES,
    ActorSlots,
    RunAbortedError,
    error_summary,
)

__all__ = ["FAILURE_WINDOW", "MAX_CONSECUTIVE_FAILURES", "Completed", "RunAbortedError", "RunnerPool", "error_summary"]


@dataclass
class InFlight:
    runner: int
    generation: int  # the runner slot's generation when the sample was asked for
    meta_ref: ray.ObjectRef
    data_refs: list[ray.ObjectRef]
    deadline: float


@dataclass
class Completed:
    runner: int
    meta: dict[str, Any]
    data_refs: list[ray.ObjectRef]  # one fragment per trainable policy (one in single-agent PPO)

    @property
    def data_ref(self) -> ray.ObjectRef:
        return self.data_refs[0]


class RunnerPool:
    def __init__(
        self,
        make_runner: Callable[[int, int], Any],
        num_runners: int,
        sample_timeout_s: float,
        num_fragments: int = 1,
        resources: dict[str, float] | None = None,
        on_failure: Callable[[RayError], None] | None = None,
        fatal: tuple[type[BaseException], ...] = (),
    ) -> None:
        """``make_runner(index, generation)`` creates the actor; generation counts replacements of that slot.
        ``num_fragments``: the data objects a sample returns after its metadata (one per trainable policy).
        ``resources``: what one runner asks Ray for (None: replacements are not checked against the nodes).
        ``on_failure(error)``: told of a sample's error before its runner is replaced (a game's driver replaces
        the generator the error names, so the new runner calls the new one).
        ``fatal``: exception types that a sample raising them makes a ``RunAbortedError`` with their message, at
        once (no replacement)."""
        self.sample_timeout_s = sample_timeout_s
        self.fatal = fatal
        self.on_failure = on_failure
        self.num_fragments = num_fragments
        self.slots = ActorSlots(
            "runner", make_runner, num_runners, resources=resources, placement_wait_s=sample_timeout_s, work="samples"
        )
        self.in_flight: dict[ray.ObjectRef, InFlight] = {}
        # The latest call of each state-setting method (weights, opponents) with its args: a replacement runner
        # gets them all before it samples.
        self.state_calls: dict[str, tuple[Any, ...]] = {}
        self.lost_fragments = 0
        self.failures: list[str] = []  # one line per failed sample, in order
        self.failure_texts: list[str] = []  # beside each: the error's whole text (a remote traceback), or the line

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

    def broadcast(self, *weights_refs: ray.ObjectRef) -> None:
        """Send one published version (one per trainable policy) to every runner: each reads the same objects
        from the store."""
        self.broadcast_call("set_weights", *weights_refs)

    def broadcast_call(self, method: str, *args: Any) -> None:
        """Call ``method(*args)`` on every runner, and on every replacement runner later."""
        self.state_calls[method] = args
        for runner in self.runners:
            getattr(runner, method).remote(*args)

    def busy(self, index: int) -> bool:
        return any(f.runner == index for f in self.in_flight.values())

    def submit(self, index: int) -> None:
        meta_ref, *data_refs = self.runners[index].sample.options(num_returns=1 + self.num_fragments).remote()
        deadline = time.monotonic() + self.sample_timeout_s
        self.in_flight[meta_ref] = InFlight(index, self.slots.generations[index], meta_ref, data_refs, deadline)

    def sample_round(self) -> list[Completed]:
        """One fragment from every runner, waited for (benchmarks and checks; the driver's loop is asynchronous).
        A runner that fails is a RuntimeError naming it."""
        for i in range(len(self)):
            self.submit(i)
        done: list[Completed] = []
        while self.in_flight:
            ready, _ = ray.wait(self.pending_refs(), num_returns=len(self.in_flight))
            completed, failed = self.collect(ready)
            if failed:
                raise RuntimeError(f"a runner failed: {self.failures[-1]}")
            done += completed
        return done

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
                self._discard(flight.data_refs)
                cause = exc.cause if isinstance(exc, RayTaskError) else None
                if self.fatal and isinstance(cause, self.fatal):
                    raise RunAbortedError(f"runner {flight.runner}: {cause}") from None
                if self.on_failure is not None:
                    self.on_failure(exc)
                reason = f"runner {flight.runner} failed: {exc.__class__.__name__}: {error_summary(exc)}"
                self._replace(flight, reason, str(exc))
                failed.append(flight.runner)
                continue
            self.slots.succeeded(flight.runner, flight.generation)
            done.append(Completed(flight.runner, meta, flight.data_refs))
        now = time.monotonic()
        for ref, flight in list(self.in_flight.items()):
            if now > flight.deadline and not ray.wait([ref], timeout=0)[0]:  # finished in time but not yet read
                del self.in_flight[ref]
                self._discard(flight.data_refs)
                self._replace(flight, f"runner {flight.runner} missed its {self.sample_timeout_s:g}s deadline")
                failed.append(flight.runner)
        return done, failed

    @staticmethod
    def _discard(refs: list[ray.ObjectRef]) -> None:
        """Give up on a sample's results; failed ones are read once so Ray does not log their errors as unhandled."""
        for ref in refs:
            if ray.wait([ref], timeout=0)[0]:
                try:
                    ray.get(ref, timeout=0)
                except RayError:
                    pass

    def _replace(self, flight: InFlight, reason: str, text: str | None = None) -> None:
        """Replace the runner a failed sample ran on (once per runner) and count its fragment as lost; the slots
        stop the run (RunAbortedError) when it fails too often. ``reason``: one line; ``text``: the error's whole
        text (None: the line says it all)."""
        self.failures.append(reason)
        self.failure_texts.append(text or reason)
        if self.slots.replace(flight.runner, flight.generation, reason):
            for method, args in self.state_calls.items():
                getattr(self.runners[flight.runner], method).remote(*args)
        self.lost_fragments += 1

    def shutdown(self) -> None:
        self.slots.shutdown()
        # Samples still running when the run ended now fail; read them so Ray does not report them as unhandled.
        refs = [r for f in self.in_flight.values() for r in (f.meta_ref, *f.data_refs)]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=5)
        self._discard(refs)
        self.in_flight.clear()
