"""RewardService: runs the configured reward functions on groups of completions, with a deadline per group.

Every configured function scores each group; their component dicts merge into one per completion. Process rewards
(``rlfabric.rewards.process_reward``) score each completion's steps (``RewardInput.steps``, the whole completion as
one step when it has none) and give one dict per step; theirs merge per step into
``RewardResult.step_components``, beside the outcome components. A component name belongs to one function, outcome
or process. Failures stay as small as they can be:

* a function that gives ``Unscored(error)`` for a sample (a judge's answer that would not parse) fails that
  sample alone;
* a function that raises (or returns something malformed: a process reward whose list for a sample is not one
  dict per step) fails only that group: its samples get the error and no components, and the other groups of the
  call are still scored;
* a group that overruns ``group_timeout_s`` fails with "timed out after Xs" and the call goes on with the next
  group. The stuck thread cannot be killed, so the service then reports itself poisoned and the pool replaces
  it once the call has returned; the groups it finished are kept. Once the call ``gives_up`` (more than half the
  groups tried timed out, 3 at least, or 6 in a row), its remaining groups are not tried here (a reward that hangs
  on every call would cost a deadline per group, minutes of silence for a large batch); the service reports them
  skipped, and the pool scores them once more on the replacement.

Pointwise functions (``rlfabric.rewards.pointwise``: reward models) run once per call on the samples of all its
groups together, so their forward passes batch across groups, under a deadline of ``group_timeout_s`` per group;
if that run fails or overruns, every group of the call fails with its error.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import queue
import threading
from collections.abc import Mapping
from typing import Any

import ray

from rlfabric import rewards
from rlfabric.rewards import (
    RewardFn,
    RewardInput,
    RewardResult,
    RewardSpec,
    Unscored,
    declared_components,
    is_pointwise,
    is_process_reward,
)

# When a service skips the rest of a call's groups: once more than half the groups it tried timed out, 3 at
# least (a reward that always hangs costs 3 deadlines, one that hangs on some groups never trips it: three running
# is likely somewhere in a call of a hundred groups), or after 6 in a row (a reward backend that went down after
# many good groups; 6 running at a 15% hang rate is a chance in 100,000).
MIN_TIMEOUTS_TO_GIVE_UP = 3
TIMEOUTS_IN_A_ROW_TO_GIVE_UP = 6


def gives_up(timeouts: int, tried: int, in_a_row: int) -> bool:
    """Whether a call that saw ``timeouts`` of its first ``tried`` groups time out, the last ``in_a_row`` of them
    one after another, skips the rest: (timeouts >= 3 and timeouts > tried / 2) or in_a_row >= 6."""
    return (timeouts >= MIN_TIMEOUTS_TO_GIVE_UP and 2 * timeouts > tried) or in_a_row >= TIMEOUTS_IN_A_ROW_TO_GIVE_UP


class TimedOut(str):
    """The error of a run that overran its deadline (its thread is still stuck): a str, told apart by its type."""


class GroupFailed(Exception):
    """Scoring one group failed; the message is the one-line error its samples carry."""


def one_line(exc: BaseException) -> str:
    """``"ExcType: message"`` on one line, at most 300 characters."""
    message = " ".join(str(exc).split())
    return f"{exc.__class__.__name__}: {message}"[:300] if message else exc.__class__.__name__


class _GroupRun:
    """One group's evaluation, run on a ``_Runner``'s thread, so the caller can stop waiting for it."""

    def __init__(self, functions: list[tuple[str, RewardFn]], group: list[RewardInput]) -> None:
        self.functions, self.group = functions, group
        self.current = ""  # the function running now: named in the timeout error
        self.results: list[RewardResult] | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            self.results = self._evaluate()
        except GroupFailed as exc:
            self.error = str(exc)
        except BaseException as exc:  # any failure of user code costs this group only
            self.error = f"{self.current}: {one_line(exc)}"

    def _evaluate(self) -> list[RewardResult]:
        """Every function on the group, outcome components merged per sample and process components per step
        (a failed result where a function gave ``Unscored``); GroupFailed on a malformed result."""
        n = len(self.group)
        outcome: list[dict[str, float]] = [{} for _ in range(n)]
        steps: list[list[dict[str, float]] | None] = [None] * n
        unscored: list[str | None] = [None] * n
        source: dict[str, str] = {}  # component -> the function that produced it
        stepped = None  # the group with its steps filled in, for process rewards
        for name, fn in self.functions:
            self.current = name
            process, declared = is_process_reward(fn), declared_components(fn)
            if process and stepped is None:
                stepped = [dataclasses.replace(s, steps=s.step_texts()) for s in self.group]
            out = fn(stepped if process else self.group)
            if not isinstance(out, list) or len(out) != n:
                got = f"{len(out)} results" if isinstance(out, list) else f"a {type(out).__name__}"
                expected = "list of per-step dicts" if process else "dict"
                raise GroupFailed(
                    f"{name}: returned {got} for a group of {n} completions; expected a list of {n}, one {expected} "
                    "per completion"
                )
            for i, result in enumerate(out):
                if isinstance(result, Unscored):
                    unscored[i] = unscored[i] or f"{name}: {result.error}"
                elif process:
                    assert stepped is not None
                    texts = stepped[i].steps or []
                    if not isinstance(result, list) or len(result) != len(texts):
                        got = f"{len(result)} dicts" if isinstance(result, list) else f"a {type(result).__name__}"
                        raise GroupFailed(
                            f"{name}: sample {i} got {got}, expected a list of {len(texts)} dicts (one per step)"
                        )
                    steps[i] = steps[i] or [{} for _ in texts]
                    for k, components in enumerate(result):
                        _merge(name, f"sample {i} step {k}", components, steps[i][k], source, declared)
                else:
                    _merge(name, f"sample {i}", result, outcome[i], source, declared)
        return [
            RewardResult({}, error) if error is not None else RewardResult(components, None, per_step)
            for components, per_step, error in zip(outcome, steps, unscored, strict=True)
        ]


class _Runner:
    """A daemon thread that evaluates group runs one at a time, kept from call to call: a thread started per group
    cost most of a cheap reward's call (1.5 of 1.8 ms for eight groups of the arithmetic reward). A run that
    overruns its deadline leaves the thread stuck in it; the service then starts a new runner."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[_GroupRun, threading.Event]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="reward-group", daemon=True).start()

    def _loop(self) -> None:
        while True:
            run, done = self._jobs.get()
            run.run()
            done.set()

    def finished(self, run: _GroupRun, timeout_s: float) -> bool:
        """Evaluate ``run``; False when it is still running after ``timeout_s``."""
        done = threading.Event()
        self._jobs.put((run, done))
        return done.wait(timeout_s)


def _merge(
    name: str,
    where: str,
    components: Any,
    into: dict[str, float],
    source: dict[str, str],
    declared: frozenset[str] | None = None,
) -> None:
    """Add function ``name``'s ``components`` for one sample (or step) to ``into``; GroupFailed when they are not
    a dict of finite numbers, name a component another function produces, or one the function does not declare
    (``declared``: its ``@gives``; None: any)."""
    if not isinstance(components, Mapping):
        hint = (
            f", e.g. {{'correct': {components!r}}} ('correct' is what held-out accuracy reads)"
            if isinstance(components, numbers.Real)
            else " (rlfabric.rewards.Unscored('why') for a sample it cannot score)"
            if components is None
            else ""
        )
        raise GroupFailed(f"{name}: {where} got a {type(components).__name__}, expected a dict{hint}")
    for key, value in components.items():
        if declared is not None and key not in declared:
            raise GroupFailed(
                f"{name}: {where} gave component {key!r}, which it does not declare (@gives: "
                f"{', '.join(sorted(declared))})"
            )
        if source.setdefault(key, name) != name:
            raise GroupFailed(f"component {key!r} comes from both {source[key]!r} and {name!r}")
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise GroupFailed(f"{name}: component {key!r} is {value!r}, expected a finite number")
        into[key] = float(value)


class RewardServiceCore:
    """The service's logic without Ray, so it can be used and tested in-process."""

    def __init__(
        self,
        specs: list[str | Mapping[str, Any] | RewardSpec],
        group_timeout_s: float,
        registry_blob: bytes | None = None,
    ) -> None:
        if registry_blob is not None:
            rewards.load_snapshot(registry_blob)
        if not group_timeout_s > 0:
            raise ValueError(f"group_timeout_s = {group_timeout_s!r}: must be > 0")
        parsed = [RewardSpec.parse(s, f"rewards.functions[{i}]") for i, s in enumerate(specs)]
        if not parsed:
            raise ValueError("RewardService needs at least one reward function, got none")
        self.functions = [
            (spec.name, rewards.resolve_reward(spec, f"rewards.functions[{i}]")) for i, spec in enumerate(parsed)
        ]
        self.group_timeout_s = group_timeout_s
        self.poisoned = False  # a group's thread is stuck: this process should be replaced
        self._runner: _Runner | None = None  # started at the first group
        self.skipped: list[int] = []  # the last call's groups not tried once it gave up (``gives_up``)

    def score(self, groups: list[list[RewardInput]]) -> list[list[RewardResult]]:
        """Results per group, per completion; a failed group's samples carry its error and no components. The
        groups skipped once the call ``gives_up`` fail too, and their indices are in ``skipped``."""
        per_sample = [(n, f) for n, f in self.functions if is_pointwise(f)]
        per_group = [(n, f) for n, f in self.functions if not is_pointwise(f)]
        across = self._score_across(groups, per_sample) if per_sample else [None] * len(groups)
        out = []
        self.skipped, timeouts, tried, in_a_row, last_timeout = [], 0, 0, 0, ""
        for index, (group, first) in enumerate(zip(groups, across, strict=True)):
            if isinstance(first, str):  # the pointwise run failed: so does every group of the call
                out.append(failed(group, first))
                continue
            if gives_up(timeouts, tried, in_a_row):
                self.skipped.append(index)
                out.append(
                    failed(group, f"not scored: {timeouts} of the {tried} groups tried before it {last_timeout}")
                )
                continue
            results = (
                self._run(per_group, group, self.group_timeout_s) if per_group else [RewardResult({}) for _ in group]
            )
            timed_out = isinstance(results, TimedOut)
            tried, timeouts, in_a_row = tried + 1, timeouts + int(timed_out), in_a_row + 1 if timed_out else 0
            if isinstance(results, str):
                last_timeout = results if timed_out else last_timeout
                results = failed(group, str(results))
            out.append(merge_results(first, results) if first is not None else results)
        return out

    def _score_across(
        self, groups: list[list[RewardInput]], functions: list[tuple[str, RewardFn]]
    ) -> list[list[RewardResult] | str]:
        """The pointwise functions on every sample of ``groups`` in one run, split back per group; each group's
        entry is the error string instead when the run failed."""
        flat = [sample for group in groups for sample in group]
        results = self._run(functions, flat, self.group_timeout_s * max(len(groups), 1))
        if isinstance(results, str):
            return [results] * len(groups)
        out: list[list[RewardResult] | str] = []
        start = 0
        for group in groups:
            out.append(results[start : start + len(group)])
            start += len(group)
        return out

    def _run(
        self, functions: list[tuple[str, RewardFn]], group: list[RewardInput], timeout_s: float
    ) -> list[RewardResult] | str:
        """Each sample's result, or the one-line error of a run that failed as a whole (raised, malformed,
        overran its deadline: a ``TimedOut``)."""
        if not group:
            return []
        run = _GroupRun(functions, group)
        if self._runner is None:
            self._runner = _Runner()
        if not self._runner.finished(run, timeout_s):
            self.poisoned = True
            self._runner = None  # stuck in this run: the next one gets a thread of its own
            return TimedOut(f"timed out after {timeout_s:g}s in reward {run.current!r}")
        if run.results is None:
            return run.error or "no result"
        return run.results


def failed(group: list[RewardInput], error: str) -> list[RewardResult]:
    return [RewardResult({}, error) for _ in group]


def merge_results(first: list[RewardResult], second: list[RewardResult]) -> list[RewardResult]:
    """Per sample, the components (and per-step components) of both, or the error of the one that failed it; a
    component named by both is an error for the group, as it is between two per-group functions."""
    clash = sorted({k for a, b in zip(first, second, strict=True) for k in component_names(a) & component_names(b)})
    if clash:
        return [
            RewardResult({}, f"component {clash[0]!r} comes from a pointwise and a per-group reward") for _ in first
        ]
    return [
        RewardResult({}, a.error or b.error)
        if a.error or b.error
        else RewardResult({**a.components, **b.components}, None, merge_steps(a.step_components, b.step_components))
        for a, b in zip(first, second, strict=True)
    ]


def component_names(result: RewardResult) -> set[str]:
    """Every component a result holds, outcome and per-step."""
    return set(result.components) | {k for step in result.step_components or [] for k in step}


def merge_steps(a: list[dict[str, float]] | None, b: list[dict[str, float]] | None) -> list[dict[str, float]] | None:
    """Two functions' per-step components of one sample, merged step by step (None: that side scored no steps)."""
    if a is None or b is None:
        return a if b is None else b
    return [{**x, **y} for x, y in zip(a, b, strict=True)]


@ray.remote
class RewardService:
    """The Ray actor. ``score`` returns two objects: the results, and (whether this process is now poisoned, the
    indices of the groups it skipped)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.core = RewardServiceCore(*args, **kwargs)

    def pid(self) -> int:
        return os.getpid()

    @ray.method(num_returns=2)
    def score(self, groups: list[list[RewardInput]]) -> tuple[list[list[RewardResult]], tuple[bool, list[int]]]:
        results = self.core.score(groups)
        return results, (self.core.poisoned, self.core.skipped)
