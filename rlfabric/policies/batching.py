"""One policy call per batch of the requests of many episodes in flight.

A rollout worker runs its episodes as asyncio tasks; each asks for one action at a time with
``await batcher.act(observation)``. The requests made while the event loop runs the other episodes' ready work
(all the episodes woken by the previous call's results, or by their env steps finishing together) are sent in
one ``policy.act`` call of at most ``max_batch`` observations. Calls overlap: requests that arrive while one call
is out go out in the next, without waiting for it, so a served policy keeps its engines busy. A request may
carry a session key (a conversation's); a policy that keeps conversations (``uses_sessions``, as a served
language model does) gets a batch's keys as ``act(observations, sessions)``, any other policy ignores them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlfabric.policies.base import Policy, PolicyOutput


class ActBatcher:
    """Batches single-episode ``act`` requests into calls of ``policy`` (see the module docstring).

    A policy with an ``act_async`` coroutine (a served one, waiting on remote calls) is awaited; otherwise
    ``act`` runs inline on the event loop (a local net acts in microseconds). A call that raises fails only the
    requests in its batch, each with that exception.
    """

    def __init__(self, policy: Policy, max_batch: int = 256, linger_s: float = 0.0) -> None:
        if max_batch < 1:
            raise ValueError(f"ActBatcher max_batch = {max_batch}: must be at least 1")
        self.policy = policy
        self.max_batch = max_batch
        self.linger_s = linger_s  # > 0: wait this long for more requests before sending a batch
        self.pending: list[tuple[Any, str | None, asyncio.Future]] = []
        self.scheduled = False
        self.in_flight: set[asyncio.Task] = set()  # held so the loop does not drop a running call
        self.calls = 0  # policy calls made
        self.requests = 0  # observations sent in them

    async def act(self, observation: Any, session: str | None = None) -> PolicyOutput:
        """The policy's output for this one observation (a ``PolicyOutput`` of length 1); ``session``: the key of
        the conversation it continues, if any."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self.pending.append((observation, session, answer))
        if not self.scheduled:
            self.scheduled = True
            # call_soon runs after the callbacks already ready, i.e. after the other episodes woken together
            # have made their requests too.
            if self.linger_s > 0:
                loop.call_later(self.linger_s, self._launch)
            else:
                loop.call_soon(self._launch)
        return await answer

    def _launch(self) -> None:
        self.scheduled = False
        while self.pending:
            batch, self.pending = self.pending[: self.max_batch], self.pending[self.max_batch :]
            task = asyncio.ensure_future(self._call(batch))
            self.in_flight.add(task)
            task.add_done_callback(self.in_flight.discard)

    async def _call(self, batch: list[tuple[Any, str | None, asyncio.Future]]) -> None:
        observations = [obs for obs, _, _ in batch]
        sessions = [session for _, session, _ in batch]
        uses_sessions = getattr(self.policy, "uses_sessions", False)
        keyed = (sessions,) if uses_sessions and any(key is not None for key in sessions) else ()
        self.calls += 1
        self.requests += len(batch)
        try:
            act_async = getattr(self.policy, "act_async", None)
            if act_async is not None:
                out = await act_async(observations, *keyed)
            else:
                out = self.policy.act(observations, *keyed)
            if len(out) != len(batch):
                raise RuntimeError(f"{type(self.policy).__name__}.act returned {len(out)} actions for {len(batch)}")
        except Exception as exc:  # noqa: BLE001 - handed to each waiting episode, which decides what it means
            for *_, answer in batch:
                if not answer.done():
                    answer.set_exception(exc)
            return
        for i, (*_, answer) in enumerate(batch):
            if not answer.done():  # its episode may have been cancelled meanwhile
                answer.set_result(out.take(slice(i, i + 1)))
