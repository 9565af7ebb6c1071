"""A language-model policy served by generator actors, called by the rollout worker.

The worker hands it token-id prompts; it splits them over the generators it was given (keeping each unit of
``keep_together`` consecutive prompts, a GRPO group, on one generator, where the engine shares their prefix), puts
one deadline over all the calls, and returns the completions in order as a ``PolicyOutput``: sampled token ids,
their behaviour logprobs and the version of the weights that sampled them. A generator that raises or misses the
deadline fails the call with ``GeneratorsFailed``, naming it by slot and generation, so the driver can replace it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
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


class ServedLLMPolicy:
    """See the module docstring. ``params`` are SamplingParams fields; ``timeout_s`` the deadline of one call."""

    def __init__(
        self, generators: Sequence[GeneratorRef], params: dict[str, Any], timeout_s: float, keep_together: int = 1
    ) -> None:
        if not generators:
            raise ValueError("ServedLLMPolicy needs at least one generator")
        self.generators = list(generators)
        self.params = params
        self.timeout_s = timeout_s
        self.keep_together = keep_together
        self.version = -1  # newest version seen in a completion

    def _send(self, prompts: Sequence[list[int]]) -> list[tuple[int, int, slice, ray.ObjectRef]]:
        """One ``generate`` call per generator, on consecutive shares of whole units."""
        unit = self.keep_together
        n_units = -(-len(prompts) // unit)
        per = -(-n_units // len(self.generators)) * unit
        calls = []
        for k, (slot, generation, handle) in enumerate(self.generators):
            rows = slice(k * per, min((k + 1) * per, len(prompts)))
            if rows.start < rows.stop:
                calls.append((slot, generation, rows, handle.generate.remote(list(prompts[rows]), self.params)))
        return calls

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
                out[rows] = result
        if failures:
            raise GeneratorsFailed(failures)
        return self._output(out)

    def act(self, observations: Sequence[list[int]]) -> PolicyOutput:
        """Completions of the prompts ``observations`` (token ids), in order; blocks until all are back."""
        calls = self._send(observations)
        deadline = time.monotonic() + self.timeout_s
        results: list[Any] = []
        for *_, ref in calls:
            try:
                results.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except ray.exceptions.RayError as exc:  # GetTimeoutError is one
                results.append(exc)
        return self._collect(calls, results, len(observations))

    async def act_async(self, observations: Sequence[list[int]]) -> PolicyOutput:
        """``act`` for a worker's event loop: the calls are awaited, so its other episodes go on meanwhile."""
        calls = self._send(observations)
        results = await asyncio.gather(
            *(asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout_s) for *_, ref in calls),
            return_exceptions=True,
        )
        return self._collect(calls, list(results), len(observations))
