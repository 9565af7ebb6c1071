"""Sampling for the torch engine: one token per row of logits, each row with its own temperature, top-k and top-p,
and the logprob of the chosen token as the learner recomputes it.
"""

from __future__ import annotations

import torch

from rlfabric.engines.base import SamplingParams


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator
) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` [batch, vocab], each row with its own sampling parameters.

    Rows with temperature 0 take the argmax. The returned logprob is ``log_softmax(logits / temperature)`` of the
    chosen token (temperature 1 for greedy rows), before top-k/top-p truncation: the number the learner recomputes.
    """
    device = logits.device
    greedy = [p.temperature == 0 for p in params]
    temperature = torch.tensor([p.temperature or 1.0 for p in params], device=device)
    scaled = logits.float() / temperature[:, None]
    if all(greedy):
        tokens = scaled.argmax(-1)
    else:
        truncated = _truncate(scaled, params) if any(p.top_k or p.top_p < 1 for p in params) else scaled
        tokens = sample_from_probs(truncated.softmax(-1), generator)
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy, device=device), scaled.argmax(-1), tokens)
    logprobs = scaled.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), logprobs.tolist()


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of ``probs`` [batch, vocab], by inverting each row's CDF at one uniform draw.

    The same distribution as ``torch.multinomial(probs, 1)``, which on CPU draws an exponential per vocabulary
    entry: one random number per row instead makes it 6x faster at 80 tokens and 28x at 32,000. Zero-probability
    entries are never chosen (their CDF step is empty).
    """
    cdf = probs.cumsum(-1)
    draw = torch.rand(len(probs), 1, generator=generator, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, draw, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _truncate(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) the logits outside each row's top-k, then outside its top-p nucleus (transformers' order)."""
    device, vocab = scaled.device, scaled.shape[-1]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
    # top_p == 1 keeps everything; inf avoids dropping tail tokens whose cumulative mass rounds up to 1.
    top_p = torch.tensor([p.top_p if p.top_p < 1 else float("inf") for p in params], device=device)
    sorted_logits, order = scaled.sort(-1, descending=True)
    ranks = torch.arange(vocab, device=device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # the first token always stays: its mass_before is 0
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
