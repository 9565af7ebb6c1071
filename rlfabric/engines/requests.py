"""One prompt's request inside the torch engine: its sampling parameters and stop tokens, the tokens generated so
far, and the future its ``generate`` call awaits. ``rlfabric.engines.torch_engine`` queues and admits requests;
its decoders (``rlfabric.engines.fast_decoder``, ``rlfabric.engines.hf_decoder``) step them to completion.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from rlfabric.engines.base import Completion, FinishReason, SamplingParams


@dataclass(eq=False)
class EngineRequest:
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    future: asyncio.Future
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version: int = -1  # stamped at admission
    finish_reason: FinishReason | None = None
    session: str | None = None  # keep this conversation's KV for its next turn (rlfabric.engines.session_cache)
    stop_text: Callable[[list[int]], bool] | None = None  # True once the tokens' text holds a stop string

    @property
    def abandoned(self) -> bool:
        """The caller went away (its generate call was cancelled, e.g. by a deadline): stop spending compute."""
        return self.future.done()

    @property
    def final_length(self) -> int:
        """Cache positions this request may need: prompt plus every generated token."""
        return len(self.prompt) + self.params.max_new_tokens

    def append(self, token: int, logprob: float) -> bool:
        """Record one generated token; True when the request is finished."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids or (self.stop_text is not None and self.stop_text(self.tokens)):
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None or self.abandoned

    def completion(self) -> Completion:
        assert self.finish_reason is not None
        return Completion(self.prompt, self.tokens, self.logprobs, self.finish_reason, self.version)
