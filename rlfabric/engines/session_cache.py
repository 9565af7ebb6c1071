"""Session continuation for the torch engine: a conversation's KV cache kept between its turns.

A multi-turn episode calls ``generate`` once per turn, each time with the whole conversation so far as the prompt:
the previous prompt, the tokens sampled for it, and the env's reply. Prefilling that prompt from scratch costs
every earlier turn again (turn k prefills turns 1..k-1), which is what a loop that re-tokenizes the chat pays.
With a session key on the request, the engine instead keeps the finished request's KV rows here and, when the
session's next request arrives, copies them back into its slot and prefills only the new tokens.

Entries are exact: one holds the token ids whose keys and values it stores, and a new prompt reuses only its
longest common prefix with them (so a caller that edits history loses nothing but speed). The store is bounded by
a token budget and evicts the least recently stored sessions first; a weight update clears it (the stored keys
and values came from the old weights).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import torch


class CachedPrefix(NamedTuple):
    """A session's stored KV: ``keys``/``values`` [layers, kv_heads, len(tokens), head_dim] for ``tokens``."""

    tokens: list[int]
    keys: torch.Tensor
    values: torch.Tensor


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading positions where ``a`` and ``b`` agree: ``max n`` with ``a[:n] == b[:n]``."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SessionCache:
    """Stored KV prefixes by session key, least recently stored evicted first past ``max_tokens`` in all.

    ``take`` removes the entry it returns: the running request owns those rows now, and stores its longer
    conversation when it finishes.
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"session cache max_tokens = {max_tokens}: must be >= 0 (0 turns sessions off)")
        self.max_tokens = max_tokens
        self.entries: OrderedDict[str, CachedPrefix] = OrderedDict()
        self.tokens = 0  # stored in all
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, session: str, prefix: CachedPrefix) -> None:
        """Store ``prefix`` for ``session`` (replacing any older entry), then evict down to the budget."""
        self.discard(session)
        if len(prefix.tokens) > self.max_tokens:
            return
        self.entries[session] = prefix
        self.tokens += len(prefix.tokens)
        while self.tokens > self.max_tokens:
            _, evicted = self.entries.popitem(last=False)
            self.tokens -= len(evicted.tokens)
            self.evictions += 1

    def take(self, session: str, prompt: Sequence[int]) -> CachedPrefix | None:
        """The stored prefix of ``prompt`` for ``session``, trimmed to what they share and leaving at least one
        prompt token to prefill (its logits start the generation); None when nothing is reusable."""
        entry = self.entries.pop(session, None)
        if entry is None:
            return None
        self.tokens -= len(entry.tokens)
        reuse = min(common_prefix_length(entry.tokens, prompt), len(prompt) - 1)
        if reuse <= 0:
            return None
        return CachedPrefix(entry.tokens[:reuse], entry.keys[:, :, :reuse], entry.values[:, :, :reuse])

    def discard(self, session: str) -> None:
        entry = self.entries.pop(session, None)
        if entry is not None:
            self.tokens -= len(entry.tokens)

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0
