"""The driver's view of its reward services: split groups across them, wait with deadlines, replace the broken.

One remote call per worker per batch of groups, never one per sample. Failures cost as little as possible:

* a reward function that raises or overruns its per-group deadline fails only that group; the service handles
  both itself and its call returns in time, so groups it finished are kept. A service with a timed-out group
  says it is poisoned (a stuck thread cannot be killed) and is replaced once its call returns; the groups it
  skipped after several timeouts in a row are scored once more on the replacement;
* a service whose process dies (killed, or its node lost) is replaced, and that call's groups are scored again on
  the replacement, once: the death was not their reward's fault. If the replacement dies on them too (a reward
  that crashes its process), they are recorded as failed;
* a service stuck as a whole misses the driver's backstop deadline (``timeout_s`` per group of the call plus
  ``grace_s``): it is killed and replaced, and that call's groups are recorded as failed (a retry would wait out
  the same backstop again).

Every wait has a deadline, so scoring never hangs. ``submit``/``collect`` let the driver overlap scoring with
other work; ``score`` is the two in a row.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from rlfabric import rewards
from rlfabric.actor_slots import ActorSlots, error_summary
from rlfabric.rewards import RewardInput, RewardResult, RewardSpec

KEEP_ERRORS = 5


@dataclass
class _Call:
    """One remote ``score`` call: a worker's share of a ticket's groups."""

    worker: int
    generation: int  # the slot's generation when the call was made: a replaced worker is not replaced twice
    group_indices: list[int]
    groups: list[list[RewardInput]]  # kept to score again, once, if the worker dies on them
    results_ref: ray.ObjectRef
    status_ref: ray.ObjectRef  # (poisoned, the indices of the groups it skipped)
    deadline: float
    budget_s: float
    retry: bool = False  # the second try of groups whose first worker died


class RewardPoolClosed(Exception):
    """A call asked of a pool that was shut down (by another thread of a closing rollout worker)."""


@dataclass
class RewardTicket:
    """Groups submitted for scoring; ``RewardPool.collect`` turns it into results."""

    num_groups: int
    calls: list[_Call] = field(default_factory=list)


class RewardPool:
    def __init__(
        self,
        specs: list[str | Mapping[str, Any] | RewardSpec],
        num_workers: int,
        timeout_s: float,
        num_cpus_per_worker: float = 1.0,
        snapshot: bytes | None = None,
        grace_s: float = 30.0,
        num_gpus_per_worker: float = 0.0,
        resources: dict[str, float] | None = None,
        placement: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """``specs``: the reward functions (names or {name, kwargs}); ``timeout_s``: the deadline for one group.

        ``snapshot`` is the reward registry to ship (default: this process's registrations, taken now).
        ``grace_s`` is added to each call's backstop deadline, for starting a replacement worker and transfers.
        ``num_gpus_per_worker``, ``resources``: what else one worker asks Ray for (a GPU for a reward model).
        ``placement``: each worker slot's scheduling options (its placement group bundle, ``ray.placement.rewards``),
        which its replacements keep; none: Ray places the workers.
        """
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers = {num_workers!r}: must be an integer >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s = {timeout_s!r}: must be > 0")
        self.specs = [RewardSpec.parse(s, f"rewards.functions[{i}]") for i, s in enumerate(specs)]
        if not self.specs:
            raise ValueError("RewardPool needs at least one reward function, got none")
        for i, spec in enumerate(self.specs):  # fail on the driver, before any actor starts
            rewards.resolve_reward(spec, f"rewards.functions[{i}]")
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self.num_cpus_per_worker = num_cpus_per_worker
        self.num_gpus_per_worker, self.resources = num_gpus_per_worker, dict(resources or {})
        self.placement = list(placement)
        self.snapshot = rewards.snapshot() if snapshot is None else snapshot
        # A slot replaced more than 5 times in a row, with no clean call in between, is a bug, not bad luck.
        self.slots = ActorSlots("reward worker", lambda slot, generation: self._start_worker(slot), num_workers)
        self.busy_until = [0.0] * num_workers  # when each worker's queued calls must be done, at the latest
        self.failed_samples = 0
        self.last_errors: list[str] = []  # the most recent distinct errors, newest last
        self.replaced: list[str] = []  # "reward worker N replaced (why)" since the last take_replaced()

    @property
    def workers(self) -> list[Any]:
        return self.slots.handles

    @property
    def worker_restarts(self) -> int:
        return self.slots.restarts

    def __len__(self) -> int:
        return len(self.workers)

    def take_replaced(self) -> list[str]:
        """The replacements since the last call, one line each (for the run's console), and forget them."""
        taken, self.replaced = self.replaced, []
        return taken

    def _start_worker(self, slot: int) -> Any:
        from rlfabric.actors.reward_service import RewardService

        specs = [spec.to_dict() for spec in self.specs]
        options: dict[str, Any] = {"num_cpus": self.num_cpus_per_worker, "num_gpus": self.num_gpus_per_worker}
        if self.resources:
            options["resources"] = self.resources
        if slot < len(self.placement):
            options.update(self.placement[slot])
        return RewardService.options(**options).remote(specs, self.timeout_s, self.snapshot)

    def pids(self, timeout_s: float = 60.0) -> list[int]:
        """Each worker's process id (waits for workers still starting)."""
        return ray.get([w.pid.remote() for w in self.workers], timeout=timeout_s)

    def submit(self, groups: list[list[RewardInput]]) -> RewardTicket:
        """Start scoring ``groups``: one call per worker on a contiguous share of them; returns at once."""
        ticket = RewardTicket(len(groups))
        shares = min(len(self.workers), len(groups))
        # The least busy workers take the shares, so a backlog on one worker does not delay the rest.
        order = sorted(range(len(self.workers)), key=lambda w: self.busy_until[w])[:shares]
        start = 0
        for k, worker in enumerate(order):
            count = len(groups) // shares + (k < len(groups) % shares)
            indices = list(range(start, start + count))
            start += count
            ticket.calls.append(self._call(worker, [groups[i] for i in indices], indices))
        return ticket

    def _call(self, worker: int, groups: list[list[RewardInput]], indices: list[int], retry: bool = False) -> _Call:
        handles = self.workers  # shut down by another thread meanwhile: the call fails as a stopped worker's
        if worker >= len(handles):
            raise RewardPoolClosed(stopped(worker))
        results_ref, status_ref = handles[worker].score.remote(groups)
        budget = self.timeout_s * len(groups) + self.grace_s
        # A call queued behind others on the same worker can start only when they are done.
        deadline = max(time.monotonic(), self.busy_until[worker]) + budget
        self.busy_until[worker] = deadline
        generation = self.slots.generations[worker]
        return _Call(worker, generation, indices, groups, results_ref, status_ref, deadline, budget, retry)

    def collect(self, ticket: RewardTicket) -> list[list[RewardResult]]:
        """Results for every group of the ticket, in submission order; waits until the calls' deadlines at most."""
        results: list[list[RewardResult]] = [[] for _ in range(ticket.num_groups)]
        for call in ticket.calls:
            for index, group_results in zip(call.group_indices, self._finish(call), strict=True):
                results[index] = group_results
        for group_results in results:
            for result in group_results:
                if result.error is not None:
                    self.failed_samples += 1
                    self._note_error(result.error)
        return results

    def score(self, groups: list[list[RewardInput]]) -> list[list[RewardResult]]:
        return self.collect(self.submit(groups))

    def _finish(self, call: _Call) -> list[list[RewardResult]]:
        """One call's results, or its groups failed with the reason the call did not deliver."""
        ready, _ = ray.wait([call.results_ref], timeout=max(0.0, call.deadline - time.monotonic()))
        if not ready:
            error = f"reward worker {call.worker} missed its {call.budget_s:g}s deadline and was replaced"
            self._replace(call, error)
            return _failed(call, error)
        try:
            results, (poisoned, skipped) = ray.get([call.results_ref, call.status_ref], timeout=self.grace_s)
        except RayTaskError as exc:  # score() itself raised: the process is fine, this call's groups are not
            return _failed(call, f"reward worker {call.worker} failed: {error_summary(exc)}")
        except RayError as exc:  # the process died (or was replaced while this call waited)
            if self.slots.closed:  # stopped on purpose (the run is closing): no replacement, no second try
                return _failed(call, stopped(call.worker))
            error = f"reward worker {call.worker} died: {exc.__class__.__name__}: {error_summary(exc)}"
            self._replace(call, error, failure=not call.retry)  # one failure per call, however many tries
            if isinstance(exc, RayActorError) and not call.retry:
                try:
                    return self._finish(self._call(call.worker, call.groups, call.group_indices, retry=True))
                except RewardPoolClosed as closed:
                    return _failed(call, str(closed))
            return _failed(call, error + (" (the second worker to die on these groups)" if call.retry else ""))
        self.slots.succeeded(call.worker, call.generation)  # it answered: whatever it scored is kept
        if poisoned:  # its results are complete; only the process is unusable (a stuck thread cannot be killed)
            self._replace(call, f"reward worker {call.worker} was poisoned by a timed-out group", failure=False)
        if skipped and not call.retry and not self.slots.closed:  # not tried after timeouts in a row: once more
            groups, indices = [call.groups[i] for i in skipped], [call.group_indices[i] for i in skipped]
            try:
                again = self._call(call.worker, groups, indices, retry=True)
            except RewardPoolClosed:  # they keep their "not scored" error
                return results
            for i, group_results in zip(skipped, self._finish(again), strict=True):
                results[i] = group_results
        return results

    def _replace(self, call: _Call, reason: str, failure: bool = True) -> None:
        """Kill the worker that made ``call`` and start a fresh one in its slot (unless that already happened).

        Calls of other tickets still queued on the killed worker fail when they are collected. ``failure``: the
        worker itself failed (it died or missed the backstop), which counts toward the limit of replacements in
        a row; a worker poisoned by one hung group returned the rest and does not.
        """
        if self.slots.replace(call.worker, call.generation, reason, failure=failure):
            self.busy_until[call.worker] = time.monotonic()
            self.replaced.append(f"reward worker {call.worker} replaced ({reason})")

    def _note_error(self, error: str) -> None:
        if error in self.last_errors:
            self.last_errors.remove(error)
        self.last_errors.append(error)
        del self.last_errors[:-KEEP_ERRORS]

    def shutdown(self) -> None:
        self.slots.shutdown()


def stopped(worker: int) -> str:
    """The error of groups whose worker the pool's shutdown stopped."""
    return f"reward worker {worker} was stopped: the reward pool shut down"


def _failed(call: _Call, error: str) -> list[list[RewardResult]]:
    return [[RewardResult({}, error) for _ in group] for group in call.groups]
