"""Slots of interchangeable actors of one role, replaced by generation when they fail.

The one fault mechanism for every role: env runners (``RunnerPool``), reward services (``RewardPool``),
generators and rollout workers (the LLM driver). Every piece of work is handed out with the (slot, generation) of
the actor doing it; a failure report names both. ``replace`` starts a fresh
actor in the slot only when the report is about the slot's current generation, so several reports about one dead
actor (a late reply, or two requests in flight on it) replace it once. A slot that fails too often is a bug, not
bad luck: the run stops with its last error, after ``MAX_CONSECUTIVE_FAILURES`` + 1 failures in a row with no
success in between, or when half of its last ``FAILURE_WINDOW`` outcomes were failures (work that fails every
other time, each replacement's first call succeeding, never fails twice in a row).

A replacement needs a node that can hold it: when the failed actor's node died with the only resources of its
kind, a pending replacement would make every later call wait out its deadline. ``replace`` waits a while for such
a node to join, then stops the run with a ``PlacementError`` naming the resources asked for.
"""

from __future__ import annotations

import re
import sysconfig
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayError, RayTaskError

MAX_CONSECUTIVE_FAILURES = 5
# A slot's last outcomes looked at: the run stops when half of them were failures.
FAILURE_WINDOW = 2 * (MAX_CONSECUTIVE_FAILURES + 1)


MAX_SUMMARY = 300  # characters of an error said on one line


def error_summary(exc: BaseException) -> str:
    """The last line of an exception's text (for a remote error: the original exception), at most 300 chars: a
    longer one ends at its last full sentence within them (Ray's dead-actor text goes on with a list of causes).
    An error raised in an actor names where in user code it was raised: ``(at envs.py:12, in step)``."""
    text = str(exc).strip()
    if not text:
        return exc.__class__.__name__
    line = text.splitlines()[-1].strip()
    if len(line) > MAX_SUMMARY:
        end = line.rfind(". ", MAX_SUMMARY // 3, MAX_SUMMARY)  # a sentence end that keeps most of what fits
        line = line[: end + 1] if end > 0 else line[: MAX_SUMMARY - 3] + "..."
    where = remote_location(exc)
    return f"{line} (at {where})" if where else line


_EXCEPTION_NAME = re.compile(r"[A-Z]\w*(Error|Exception|Timeout|Interrupt)")
_QUOTED_OR_NUMBER = re.compile(r"'[^']*'|\"[^\"]*\"|\d+(\.\d+)?")


def error_kind(error: str) -> str:
    """What one failed sample's error is an instance of: ``function: ExceptionType`` for a function that raised
    (``"doubled: ValueError: cannot parse 'xy'"``), else the text with its quoted values and numbers blanked
    (``"judge: no verdict that parses after … tries; it wrote …"``), so errors that differ only in the sample they
    quote are one kind."""
    function, _, rest = error.partition(": ")
    exception = rest.partition(": ")[0]
    if rest and _EXCEPTION_NAME.fullmatch(exception):
        return f"{function}: {exception}"
    return _QUOTED_OR_NUMBER.sub("…", error)


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _library_file(path: str) -> bool:
    """Whether a traceback's file is Python's, an installed package's or rlfabric's, not the user's code."""
    resolved = Path(path).resolve()
    return any(root in resolved.parents for root in _LIBRARY_ROOTS)


_LIBRARY_ROOTS = [
    *(Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib", "stdlib", "platstdlib")),
    Path(__file__).resolve().parent,  # rlfabric
    Path(__file__).resolve().parent.parent / "actors",  # rlfabric.actors, where the source tree is installed
]


def remote_location(exc: BaseException) -> str | None:
    """``file.py:line, in function`` of the innermost frame of user code (not Python's, an installed package's or
    rlfabric's) in the traceback of an error raised in an actor; None for any other error or when no such frame
    is in it (the error came from a library or from Ray itself)."""
    if not isinstance(exc, RayTaskError):
        return None
    text = getattr(exc, "traceback_str", None) or str(exc)  # the cause's kind of RayTaskError keeps it in its text
    for path, line, function in reversed(_FRAME.findall(text)):
        if path.startswith("<") or _library_file(path):
            continue
        return f"{Path(path).name}:{line}, in {function}"
    return None


def remote_cause(exc: BaseException) -> str:
    """``Type: message`` of what failed, on one line: for an error raised in an actor (a ``RayTaskError``), the
    actor's own exception, not Ray's text around it (the remote traceback, many lines long)."""
    while isinstance(exc, RayTaskError) and exc.cause is not None and exc.cause is not exc:
        exc = exc.cause
    if isinstance(exc, RayError):  # Ray's own failure (an actor that died): its text ends with what happened
        lines = str(exc).strip().splitlines()
        return lines[-1].strip() if lines else type(exc).__name__
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def evaluation_failure(exc: BaseException, timeout_s: float) -> str:
    """Why an evaluation call on a runner failed, on one line: a deadline missed is said with the setting that
    sets it (Ray's own text is "Get timed out: some object(s) not ready"), any other failure as ``remote_cause``."""
    if isinstance(exc, GetTimeoutError):
        return f"it did not finish within {timeout_s:g}s (runners.sample_timeout_s)"
    return remote_cause(exc)


def lost_object(exc: BaseException) -> str | None:
    """The hex id of the object whose loss failed a ``ray.get`` or a remote call that read it (its copy died with
    its node and cannot be rebuilt: ``ObjectLostError`` and its kinds, such as ``OwnerDiedError`` and
    ``ObjectReconstructionFailedError``); None when ``exc`` is any other failure."""
    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    return cause.object_ref_hex if isinstance(cause, ObjectLostError) else None


def fits_on_a_node(resources: Mapping[str, float], nodes: list[Mapping[str, float]]) -> bool:
    """Whether one of ``nodes`` (each node's total resources, as ``ray.nodes()`` reports them) has every amount in
    ``resources``."""
    return any(all(node.get(k, 0.0) >= v for k, v in resources.items() if v) for node in nodes)


def format_resources(resources: Mapping[str, float]) -> str:
    """``CPU=1, rollout=2`` (the amounts asked for, zeros left out), or ``nothing``."""
    return ", ".join(f"{k}={v:g}" for k, v in sorted(resources.items()) if v) or "nothing"


class RunAbortedError(RuntimeError):
    """The run cannot go on: an actor slot keeps failing with the same bug, or nothing can be trained."""


class PlacementError(RunAbortedError):
    """An actor that failed cannot be replaced: no alive node of the cluster has the resources it asks for."""


class ActorSlots:
    def __init__(
        self,
        role: str,
        make: Callable[[int, int], Any],
        count: int,
        max_consecutive_failures: int = MAX_CONSECUTIVE_FAILURES,
        resources: Mapping[str, float] | None = None,
        placement_wait_s: float = 0.0,
        work: str = "calls",
    ) -> None:
        """``make(slot, generation)`` starts the actor for a slot; ``role`` names it in notes and errors, and
        ``work`` what its outcomes are called there ("samples" for env runners).
        ``resources``: what one actor asks Ray for ("CPU", "GPU", custom); a replacement waits up to
        ``placement_wait_s`` for an alive node that has them (None: not checked)."""
        self.role, self.make, self.work = role, make, work
        self.max_consecutive_failures = max_consecutive_failures
        self.resources, self.placement_wait_s = resources, placement_wait_s
        self.generations = [0] * count
        self.handles = [make(i, 0) for i in range(count)]
        self.consecutive_failures = [0] * count
        self.outcomes = [deque(maxlen=FAILURE_WINDOW) for _ in range(count)]  # per slot: True for a failure
        self.restarts = 0
        self.closed = False
        self._lock = threading.Lock()  # between replace and shutdown, which may run on different threads

    def __len__(self) -> int:
        return len(self.handles)

    def entries(self) -> list[tuple[int, int, Any]]:
        """(slot, generation, handle) of every slot, as work is handed out with them."""
        return [(i, self.generations[i], h) for i, h in enumerate(self.handles)]

    def succeeded(self, slot: int, generation: int) -> None:
        """Work of ``slot``'s ``generation`` came back: its run of failures is over."""
        if generation == self.generations[slot]:
            self.consecutive_failures[slot] = 0
            self.outcomes[slot].append(False)

    def replace(self, slot: int, generation: int, reason: str, failure: bool = True) -> bool:
        """Kill and restart ``slot`` if ``generation`` is still its current one; False when it already was
        replaced (the report is about an actor that is gone). Raises RunAbortedError past the failure limit, and
        PlacementError when no alive node can hold the replacement (see ``_wait_for_room``); ``failure=False``
        replaces an actor that did its work but cannot be reused, which does not count. After ``shutdown`` nothing
        is replaced (the report is about an actor stopped on purpose)."""
        if self.closed or generation != self.generations[slot]:
            return False
        self.consecutive_failures[slot] += int(failure)
        if self.consecutive_failures[slot] > self.max_consecutive_failures:
            raise RunAbortedError(
                f"{self.role} {slot} failed {self.consecutive_failures[slot]} times in a row; last: {reason}"
            )
        if failure:
            outcomes = self.outcomes[slot]
            outcomes.append(True)
            if len(outcomes) == FAILURE_WINDOW and 2 * sum(outcomes) >= FAILURE_WINDOW:
                raise RunAbortedError(
                    f"{self.role} {slot} failed {sum(outcomes)} of its last {FAILURE_WINDOW} {self.work}; last: "
                    f"{reason}"
                )
        self._wait_for_room(slot, reason)
        with self._lock:  # a shutdown from another thread (a threaded actor closing) may have come meanwhile
            if self.closed:
                return False
            ray.kill(self.handles[slot], no_restart=True)
            self.generations[slot] += 1
            self.handles[slot] = self.make(slot, self.generations[slot])
            self.restarts += 1
        return True

    def _wait_for_room(self, slot: int, reason: str) -> None:
        """Return once an alive node has the resources one actor asks for (at once, unless its node was lost
        with the only such resources); raise PlacementError, naming them, when none joins within
        ``placement_wait_s``."""
        if self.resources is None:
            return
        deadline = time.monotonic() + self.placement_wait_s
        while not fits_on_a_node(self.resources, [n["Resources"] for n in ray.nodes() if n.get("Alive")]):
            if time.monotonic() >= deadline:
                raise PlacementError(
                    f"{self.role} {slot} cannot be replaced: no alive node has {format_resources(self.resources)} "
                    f"(waited {self.placement_wait_s:g}s for one to join); last failure: {reason}"
                )
            time.sleep(min(1.0, self.placement_wait_s))

    def shutdown(self) -> None:
        with self._lock:
            self.closed = True
            handles, self.handles = self.handles, []
        for handle in handles:
            ray.kill(handle, no_restart=True)
