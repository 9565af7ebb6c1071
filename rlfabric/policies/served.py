"""A language-model policy served by generator actors, called by the rollout worker.

The worker hands it token-id prompts; it splits them over the generators it was given (keeping each unit of
``keep_together`` consecutive prompts, a GRPO group, on one generator, where the engine shares their prefix), puts
one deadline over all the calls, and returns the completions in order as a ``PolicyOutput``: sampled token ids,
their behaviour logprobs and the version of the weights that sampled them. A generator that raises or misses the
deadline fails the call with ``GeneratorsFailed``, naming it by slot and generation, so the driver can replace it.

A rollout sent while the weights it must use are still being trained carries them as ``PendingWeights``: every
generator holds its prompts until it has loaded that version, so generation starts the moment the weights land,
without a round trip through the driver; the generation deadline starts once the loads have answered.

Multi-turn callers pass a session key per prompt (``act(observations, sessions)``): every turn of a conversation
then goes to the same generator (chosen by a hash of the key), whose engine continues the conversation's stored
KV instead of prefilling it again (``rlfabric.engines.session_cache``).
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from rlfabric.actor_slots import error_summary
from rlfabric.policies.base import PolicyOutput

# (slot, generation, actor handle) of each generator the policy may call
GeneratorRef = tuple[int, int, Any]


class GeneratorsFailed(RuntimeError):
    """Generators that raised or missed the deadline: ``failures`` is [(slot, generation, reason)]."""

    def __init__(self, failures: list[tuple[int, int, str]]) -> None:
        super().__init__("; ".join(f"generator {slot} (generation {gen}): {why}" for slot, gen, why in failures))
        self.failures = failures

    def __reduce__(self) -> tuple[type, tuple[list[tuple[int, int, str]]]]:
        # rebuilt from its failures, so it crosses processes intact (a caller's driver reads which ones failed)
        return GeneratorsFailed, (self.failures,)


@dataclass
class PendingWeights:
    """Weights a rollout must be generated with that were not loaded yet when it was sent: policy ``version``, and
    ``loads``, the calls loading it into the generators (and likelihood scorers). A load that fails ends the wait
    too: its generator is replaced, and the rollout's calls to it fail and are asked again."""

    version: int
    loads: list[ray.ObjectRef]


class ServedLLMPolicy:
    """See the module docstring. ``params`` are SamplingParams fields; ``timeout_s`` the deadline of one call;
    ``after``: weights still to be loaded that the completions must come from."""

    uses_sessions = True  # act takes a session key per prompt (rlfabric.policies.batching.ActBatcher)

    def __init__(
        self,
        generators: Sequence[GeneratorRef],
        params: dict[str, Any],
        timeout_s: float,
        keep_together: int = 1,
        after: PendingWeights | None = None,
    ) -> None:
        if not generators:
            raise ValueError("ServedLLMPolicy needs at least one generator")
        self.generators = list(generators)
        self.params = params
        self.timeout_s = timeout_s
        self.keep_together = keep_together
        self.after = after
        self.landed = after is None  # whether ``after``'s loads have answered
        self.landed_at: float | None = None  # when they did (time.perf_counter()): the rollout's generation began
        self.version = -1  # newest version seen in a completion

    def generation_began(self, sent: float) -> float:
        """When generating began for a rollout that started at ``sent`` (time.perf_counter()): then, or once its
        pending weights landed."""
        return max(sent, self.landed_at or sent)

    def _send(
        self, prompts: Sequence[list[int]], sessions: Sequence[str | None] | None
    ) -> list[tuple[int, int, list[int], ray.ObjectRef]]:
        """One ``generate`` call per generator that gets prompts: consecutive shares of whole units, or, with
        sessions, each prompt on its session's generator."""
        shares = _session_shares(sessions, len(self.generators)) if sessions is not None else self._unit_shares(prompts)
        calls = []
        for (slot, generation, handle), rows in zip(self.generators, shares, strict=True):
            if rows:
                keys = None if sessions is None else [sessions[i] for i in rows]
                after = None if self.after is None else self.after.version
                ref = handle.generate.remote([prompts[i] for i in rows], self.params, keys, after_version=after)
                calls.append((slot, generation, rows, ref))
        return calls

    def _unit_shares(self, prompts: Sequence[list[int]]) -> list[list[int]]:
        """Consecutive rows per generator, in whole units of ``keep_together``."""
        unit = self.keep_together
        n_units = -(-len(prompts) // unit)
        per = -(-n_units // len(self.generators)) * unit
        return [list(range(k * per, min((k + 1) * per, len(prompts)))) for k in range(len(self.generators))]

    def _output(self, completions: list[dict[str, Any]]) -> PolicyOutput:
        versions = [int(c["version"]) for c in completions]
        self.version = max([self.version, *versions])
        return PolicyOutput(
            [c["token_ids"] for c in completions],
            [c["logprobs"] for c in completions],
            versions,
            {"text": [c["text"] for c in completions], "finish_reason": [c["finish_reason"] for c in completions]},
        )

    def _failure(self, exc: BaseException) -> str:
        if isinstance(exc, (ray.exceptions.GetTimeoutError, asyncio.TimeoutError, TimeoutError)):
            return f"missed its {self.timeout_s:g}s generation deadline"
        return error_summary(exc) if isinstance(exc, ray.exceptions.RayError) else repr(exc)

    def _collect(self, calls: list, results: list[Any], size: int) -> PolicyOutput:
        """The calls' completions in prompt order, or ``GeneratorsFailed`` naming every call whose result is an
        exception (a missed deadline also cancels its call)."""
        out: list[dict[str, Any]] = [{}] * size
        failures = []
        for (slot, generation, rows, ref), result in zip(calls, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, (ray.exceptions.GetTimeoutError, asyncio.TimeoutError, TimeoutError)):
                    ray.cancel(ref, force=False)
                failures.append((slot, generation, self._failure(result)))
            else:
                for row, completion in zip(rows, result, strict=True):
                    out[row] = completion
        if failures:
            raise GeneratorsFailed(failures)
        return self._output(out)

    def act(self, observations: Sequence[list[int]], sessions: Sequence[str | None] | None = None) -> PolicyOutput:
        """Completions of the prompts ``observations`` (token ids), in order; blocks until all are back.
        ``sessions``: a conversation key (or None) per prompt (see the module docstring)."""
        calls = self._send(observations, sessions)
        if not self.landed:  # the generators wait for the weights; the deadline is for generating
            assert self.after is not None
            ray.wait(self.after.loads, num_returns=len(self.after.loads))
            self.landed, self.landed_at = True, time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        results: list[Any] = []
        for *_, ref in calls:
            try:
                results.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except ray.exceptions.RayError as exc:  # GetTimeoutError is one
                results.append(exc)
        return self._collect(calls, results, len(observations))

    async def act_async(
        self, observations: Sequence[list[int]], sessions: Sequence[str | None] | None = None
    ) -> PolicyOutput:
        """``act`` for a worker's event loop: the calls are awaited, so its other episodes go on meanwhile."""
        calls = self._send(observations, sessions)
        if not self.landed:  # every call sent until then waits for the weights in its generator too
            assert self.after is not None
            await asyncio.gather(
                *(asyncio.wrap_future(ref.future()) for ref in self.after.loads), return_exceptions=True
            )
            self.landed, self.landed_at = True, time.perf_counter()
        results = await asyncio.gather(
            *(asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout_s) for *_, ref in calls),
            return_exceptions=True,
        )
        return self._collect(calls, list(results), len(observations))


def _session_shares(sessions: Sequence[str | None], n_generators: int) -> list[list[int]]:
    """Rows by generator: a keyed row on ``crc32(key) % n_generators`` (stable across processes, unlike
    ``hash``), a row without a key on its index's turn."""
    shares: list[list[int]] = [[] for _ in range(n_generators)]
    for row, key in enumerate(sessions):
        shares[(zlib.crc32(key.encode()) if key is not None else row) % n_generators].append(row)
    return shares
