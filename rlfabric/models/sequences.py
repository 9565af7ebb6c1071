"""Per-token logprobs of the response in prompt + response batches for causal LMs, padded or shared-prefix packed.

The batches (``rlfabric.models.packed_batch.pack_sequences``, shared by the learner, the reference model and SFT)
hold each row's prompt LEFT-padded to the batch's longest prompt P, then the response RIGHT-padded to R, so every
response starts at column P. Position ids count real tokens only, as the generation engines do, so the learner
sees the positions the generator saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rlfabric.algorithms.grpo import entropy_from_logits, token_logprobs_from_logits
from rlfabric.models.packed_batch import is_row_column
from rlfabric.models.precision import matmul_precision
from rlfabric.models.prefix_packing import (
    SharedPrefixPack,
    cheaper_shared_prefix,
    pack_shared_prefix,
    response_logprobs_shared_prefix,
    row_budget,
)

# How a batch's rows reach the model: "shared_prefix" (``rlfabric.models.prefix_packing``), "padded" (one row
# each, as laid out here), or "auto": whichever costs the model fewer FLOPs, micro-batch by micro-batch.
SEQUENCE_PACKINGS = ("auto", "shared_prefix", "padded")


def packed_layout(
    model: Any, input_ids: np.ndarray, attention_mask: np.ndarray, prompt_len: int, packing: str
) -> SharedPrefixPack | None:
    """The shared-prefix pack ``packing`` runs this batch as, or None for the padded rows."""
    if packing == "padded":
        return None
    if packing == "shared_prefix":
        return pack_shared_prefix(input_ids, attention_mask, prompt_len, row_budget(model), feed_last=False)
    if packing == "auto":
        return cheaper_shared_prefix(model, input_ids, attention_mask, prompt_len)
    raise ValueError(f"packing = {packing!r}: expected one of {SEQUENCE_PACKINGS}")


def right_padded(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [N, W], each row right-padded with ``pad_id`` to the longest (W >= 1); a
    sequence-classification model pools each row's last real token."""
    width = max(max((len(row) for row in rows), default=1), 1)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def select_rows(batch: dict[str, Any], keep: torch.Tensor) -> dict[str, Any]:
    """The batch's rows where ``keep`` [N] is True (per-row tensors sliced; everything else as it is)."""
    return {k: v[keep] if is_row_column(v, len(keep)) else v for k, v in batch.items()}


def keep_rows_with_advantage(advantages: torch.Tensor) -> torch.Tensor:
    """[N] bool: True for rows with a nonzero advantage (``advantages`` [N], or [N, R] per token: any nonzero token);
    if there are none, for the first row alone, so an update still runs one (zero-gradient) forward and reports its
    metrics."""
    keep = advantages != 0
    if keep.dim() > 1:
        keep = keep.flatten(1).any(dim=1)
    if not bool(keep.any()) and len(keep):
        keep[0] = True
    return keep


def micro_slices(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def mini_batch_slices(n: int, parts: int) -> list[slice]:
    """``n`` rows in min(parts, n) contiguous slices whose sizes differ by at most one, larger ones first (at
    least one slice, empty for n = 0)."""
    parts = max(1, min(parts, n))
    return consecutive_slices([n // parts + int(i < n % parts) for i in range(parts)])


def consecutive_slices(sizes: list[int]) -> list[slice]:
    """Slices of the given sizes, one after another from 0."""
    ends = np.cumsum(sizes, dtype=np.int64).tolist()
    return [slice(end - size, end) for end, size in zip(ends, sizes, strict=True)]


def layout_positions(layout: SharedPrefixPack | None, input_ids: np.ndarray, prompt_len: int) -> dict[str, float]:
    """What the model runs over for one micro-batch in ``layout`` (``packed_layout``'s pack, or None for the padded
    rows ``input_ids``): ``sequences`` (rows of its input), ``positions`` (their positions, padding included) and
    ``head_positions`` (positions through the LM head)."""
    if layout is not None:
        return {
            "sequences": float(layout.input_ids.shape[0]),
            "positions": float(layout.input_ids.size),
            "head_positions": float(len(layout.target)),
        }
    rows, width = input_ids.shape
    return {
        "sequences": float(rows),
        "positions": float(rows * width),
        "head_positions": float(rows * (width - prompt_len)),
    }


@torch.no_grad()
def batched_response_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    temperature: float,
    micro_batch_size: int,
    matmul_dtype: str | None = None,
    packing: str = "padded",
) -> np.ndarray:
    """``response_logprobs`` over a whole batch, ``micro_batch_size`` rows at a time, without gradients."""
    parts = [
        response_logprobs(
            model,
            input_ids[rows],
            attention_mask[rows],
            prompt_len,
            temperature,
            matmul_dtype=matmul_dtype,
            packing=packing,
        )[0]
        .float()
        .cpu()
        for rows in micro_slices(len(input_ids), micro_batch_size)
    ]
    return torch.cat(parts).numpy()


def response_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    matmul_dtype: str | None = None,
    packing: str = "padded",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [N, R] of each response token under softmax(logits / temperature), and optionally the entropy.

    Only the R + 1 last positions go through the LM head (``logits_to_keep``): the prompt's logits are never built.
    ``matmul_dtype`` (e.g. "bfloat16") runs the body's matmuls in that dtype, see ``rlfabric.models.precision``.
    ``packing`` "shared_prefix" computes the same values over rows that share their prompt
    (``rlfabric.models.prefix_packing``; columns past a row's response are then 0), "auto" does so when that
    costs fewer FLOPs than the padded rows.
    """
    layout = packed_layout(model, input_ids.cpu().numpy(), attention_mask.cpu().numpy(), prompt_len, packing)
    return response_logprobs_in(
        model, input_ids, attention_mask, prompt_len, layout, temperature, with_entropy, matmul_dtype
    )


def response_logprobs_in(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    layout: SharedPrefixPack | None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    matmul_dtype: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``response_logprobs`` in a layout already chosen (``packed_layout``: a shared-prefix pack, or None for the
    padded rows), for callers that run the same micro-batch more than once or count what it ran over."""
    if layout is not None:
        return response_logprobs_shared_prefix(
            model, input_ids, attention_mask, prompt_len, temperature, with_entropy, matmul_dtype, pack=layout
        )
    width_r = input_ids.shape[1] - prompt_len
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with matmul_precision(model, matmul_dtype):
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=width_r + 1,
        )
    logits = out.logits[:, :-1].float()  # position t predicts token t + 1
    if temperature != 1.0:
        logits = logits / temperature
    tokens = input_ids[:, prompt_len:]
    logp = token_logprobs_from_logits(logits, tokens)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return logp, entropy
