"""Learner 0's weights to the generators (and a likelihood scorer): the transport for where the actors run,
publication, loads with a deadline, and replacement of a generator or scorer that fails its load.

Ray hands the weights' handle from learner 0 to the generators without the driver in between: the driver reads
only the new policy version and, through shared memory, the file's path (to remove it at the end).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from rlfabric.actor_slots import ActorSlots, error_summary
from rlfabric.config import ConfigError
from rlfabric.llm_resources import SETUP_TIMEOUT_S


@dataclass
class Publishing:
    """A weight publication in flight: learner 0's three answers and each generator's (and scorer's) load."""

    handle: ray.ObjectRef  # the weights (never fetched by the driver)
    version: ray.ObjectRef
    shared_path: ray.ObjectRef  # the shared-memory file's path, or None through the object store
    loads: list[tuple[int, int, ray.ObjectRef]]  # (slot, generation, load) per generator
    scorer_loads: list[tuple[int, int, ray.ObjectRef]] = field(default_factory=list)  # the same per scorer


class WeightPublisher:
    """Publishes learner 0's weights to the generators in ``generators`` and the likelihood scorers in
    ``scorers`` (and says how they travelled).

    ``fetch`` is the driver's ``ray.get`` (it counts the bytes received), ``note`` prints one line to the run's
    log, and ``replace_generator(slot, generation, reason)`` replaces a generator that failed its load (and may
    call ``publish`` for the new one); ``replace_scorer`` does the same for a scorer.
    """

    def __init__(
        self,
        wanted_transport: str,
        load_timeout_s: float,
        fetch: Callable[..., Any],
        note: Callable[[str], None],
        replace_generator: Callable[[int, int, str], None],
        replace_scorer: Callable[[int, int, str], None] | None = None,
    ) -> None:
        self.wanted_transport = wanted_transport  # learner.weight_transport
        self.load_timeout_s = load_timeout_s
        self._fetch, self._note, self._replace_generator = fetch, note, replace_generator
        self._replace_scorer = replace_scorer
        self.learner: Any = None
        self.generators: ActorSlots | None = None
        self.scorers: ActorSlots | None = None
        self.reference: Any = None
        self.transport = "object_store"  # wanted_transport made concrete by ``choose_transport``
        self.published: Any = None  # the latest published weights' handle (an ObjectRef)
        self.shared_files: set[str] = set()  # shared-memory files learner 0 wrote (removed at close)
        self.weights_via: str | None = None  # how the last publication reached the generators
        self.unfinished: Publishing | None = None  # started, not yet finished: a run that stops leaves it here

    def attach(
        self, learner: Any, generators: ActorSlots, reference: Any = None, scorers: ActorSlots | None = None
    ) -> None:
        """The actors to publish from (learner 0) and to (the generators, and the likelihood scorers that hold
        the current policy; a reference actor reads them too, once, after an SFT warm-up)."""
        self.learner, self.generators, self.reference, self.scorers = learner, generators, reference, scorers

    def publish(self, slots: Any = None, timeout: float | None = None, scorer_slots: Any = None) -> int:
        """Learner 0's current weights to the generators in ``slots`` and the scorers in ``scorer_slots`` (all
        by default), each of which has loaded them when this returns (a shared-memory file is rewritten only
        after that, see rlfabric.models.shared_weights); returns their policy version."""
        return self.finish(self.start(slots, scorer_slots), timeout)

    def start(self, slots: Any = None, scorer_slots: Any = None) -> Publishing:
        """Queue the publication and the loads (every generator and scorer unless ``slots``/``scorer_slots``
        name some), behind whatever learner 0 is doing."""
        assert self.generators is not None
        handle, version, path = self.learner.publish.remote(self.transport)
        self.unfinished = Publishing(
            handle,
            version,
            path,
            _queue_loads(self.generators, slots, handle, version),
            _queue_loads(self.scorers, scorer_slots, handle, version),
        )
        return self.unfinished

    def finish(self, publishing: Publishing, timeout: float | None = None) -> int:
        """Wait for the loads; a generator or scorer that dies or hangs while loading is replaced (and given the
        weights). Returns the published policy version."""
        version, shared_path = self._fetch([publishing.version, publishing.shared_path])
        self.published = publishing.handle
        if shared_path is not None:
            self.shared_files.add(shared_path)
        deadline = time.monotonic() + (timeout or self.load_timeout_s)
        failed_generators = self._wait(publishing.loads, deadline)
        failed_scorers = self._wait(publishing.scorer_loads, deadline)
        for slot, generation, reason in failed_generators:
            self._replace_generator(slot, generation, reason)
        if self.scorers is not None:  # a load that worked ends a scorer's run of failures
            failed = {(slot, generation) for slot, generation, _ in failed_scorers}
            for slot, generation, _ in publishing.scorer_loads:
                if (slot, generation) not in failed:
                    self.scorers.succeeded(slot, generation)
        for slot, generation, reason in failed_scorers:
            assert self._replace_scorer is not None, "scorers attached without replace_scorer"
            self._replace_scorer(slot, generation, reason)
        if publishing is self.unfinished:  # only now: a failure above leaves its loads for abandon() to collect
            self.unfinished = None
        used = "object_store" if shared_path is None else "shared_memory"
        if used != self.weights_via:  # the first time, and after any change
            self._note(self._transport_note(used))
        self.weights_via = used
        return int(version)

    def abandon(self, timeout_s: float = 5.0) -> None:
        """Collect the answers of a publication a stopped run left unfinished, once its actors are stopped: its
        loads fail when their generators shut down, and Ray reports a failure nobody collected as an "Unhandled
        error" traceback after the run's own last line."""
        if self.unfinished is None:
            return
        p, self.unfinished = self.unfinished, None
        refs = [p.handle, p.version, p.shared_path, *(load for _, _, load in [*p.loads, *p.scorer_loads])]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - collected to be dropped: the run has stopped already
                pass

    def _wait(self, loads: list[tuple[int, int, ray.ObjectRef]], deadline: float) -> list[tuple[int, int, str]]:
        """(slot, generation, reason) of each load that failed or missed ``deadline``."""
        failed = []
        for slot, generation, load in loads:
            try:
                self._fetch(load, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                failed.append((slot, generation, "missed its weight-load deadline"))
            except ray.exceptions.RayError as exc:
                failed.append((slot, generation, f"weight load failed: {error_summary(exc)}"))
        return failed

    def _transport_note(self, used: str) -> str:
        note = f"weights reach the generators through {used.replace('_', ' ')}"
        if used == "shared_memory" or self.wanted_transport == "object_store":
            return note
        if self.transport == "object_store":
            return note + " (generator/reference/scorer actors run on other nodes than learner 0)"
        reason = ray.get(self.learner.shared_unavailable.remote())  # no room in /dev/shm, or none
        return note + (f" ({reason})" if reason else "")

    def choose_transport(self) -> str:
        """``learner.weight_transport`` made concrete for where the actors run now: shared memory needs every
        reader of the weights (generators, scorers, a reference actor) on learner 0's node."""
        assert self.generators is not None
        self.transport = self.wanted_transport
        if self.wanted_transport == "object_store":
            return self.transport
        readers = [
            *self.generators.handles,
            *(self.scorers.handles if self.scorers is not None else []),
            *([self.reference] if self.reference is not None else []),
        ]
        learner_node = ray.get(self.learner.node_id.remote())
        elsewhere = sum(node not in (learner_node, None) for node in nodes_of(readers))
        if not elsewhere:
            return self.transport
        if self.wanted_transport == "shared_memory":
            raise ConfigError(
                f"learner.weight_transport = 'shared_memory': {elsewhere} generator/reference/scorer actor(s) run on "
                "another node than learner 0; use 'auto' or 'object_store'"
            )
        self.transport = "object_store"
        return self.transport


def _queue_loads(
    actors: ActorSlots | None, slots: Any, handle: ray.ObjectRef, version: ray.ObjectRef
) -> list[tuple[int, int, ray.ObjectRef]]:
    """(slot, generation, load) of each actor in ``slots`` (every one when None) asked to load the weights."""
    if actors is None:
        return []
    entries = actors.entries()
    chosen = range(len(entries)) if slots is None else slots
    return [(s, entries[s][1], entries[s][2].update_weights.remote(handle, version)) for s in chosen]


def nodes_of(actors: list[Any]) -> list[str | None]:
    """The node each actor runs on (asked all at once); None for one that died (it is replaced where it is used
    next)."""
    refs = [actor.node_id.remote() for actor in actors]
    nodes: list[str | None] = []
    for ref in refs:
        try:
            nodes.append(ray.get(ref, timeout=SETUP_TIMEOUT_S))
        except ray.exceptions.RayError:
            nodes.append(None)
    return nodes
