"""Shared-prefix packing: a group's completions in one row behind one copy of their prompt.

GRPO samples G completions of every prompt, and a warmed-up model's completions are short, so the padded layout
(``rlfabric.models.sequences``: every row is prompt + response, right-padded to the longest response) spends most
of the learner's forward and backward on G copies of each prompt and on padding. Here the rows that share a
prompt become one block, and blocks sit end to end in a packed row::

    [ prompt A | A's response 1 | A's response 2 | ... | prompt B | B's response 1 | ... | padding ]
    segment ids    0 0 0 | 1 1 | 2 2 2 | ... | 9 9 | 10 10 10 | ... | -1
    prefix ids     0 0 0 | 0 0 | 0 0 0 | ... | 9 9 |  9  9  9 | ... | -1

with each response's positions continuing from its prompt's length, and a 4D attention mask in which a token sees
its prompt and the earlier tokens of its own response only (formula: ``shared_prefix_attention``). Every response
token then gets exactly the hidden state, and so the logprob and the gradient, it gets in its own padded row; the
model runs over each prompt once and over no padding between responses. The LM head runs on the positions that
predict a response token and nowhere else.

For logprobs a response's last token is a target only: no token of the pack attends to it and its hidden state
predicts nothing, so ``feed_last=False`` leaves it out of the input (exact; with 3-4-token responses that is a
quarter of the positions). Scorers that read a hidden state at the last token (a reward model's score head) pack
with ``feed_last=True``.

``response_logprobs_shared_prefix`` has the contract of ``rlfabric.models.sequences.response_logprobs``: it takes
the padded batch and returns [N, R] in its row order, so losses, masks and metrics do not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlfabric.algorithms.grpo import entropy_from_logits, token_logprobs_from_logits
from rlfabric.models.precision import matmul_precision

# Attention implementations that honour a custom 4D mask (flash-attention kernels take only padding masks).
MASKABLE_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class SharedPrefixPack:
    """The packed rows of a padded batch of N rows and R response columns.

    input_ids, position_ids: [G, L]; segment_ids [G, L]: one id per prompt and per response within a packed row,
    -1 for padding; prefix_ids [G, L]: the segment id of the prompt each token follows (a prompt token's own);
    source: [T] flat index (into G * L) of the position whose hidden state predicts each response token;
    row, column: [T] where that token sits in the padded batch's [N, R] response columns; target: [T] the token;
    feeds_last: whether each response's last token is in the input (see the module docstring).
    """

    input_ids: np.ndarray
    position_ids: np.ndarray
    segment_ids: np.ndarray
    prefix_ids: np.ndarray
    source: np.ndarray
    row: np.ndarray
    column: np.ndarray
    target: np.ndarray
    num_rows: int
    response_width: int
    feeds_last: bool


def split_padded_row(input_ids: np.ndarray, attention_mask: np.ndarray, prompt_len: int) -> tuple[tuple, list]:
    """A padded row's (prompt tokens, response tokens): the real tokens left and right of column ``prompt_len``."""
    real = attention_mask.astype(bool)
    prompt = tuple(input_ids[:prompt_len][real[:prompt_len]].tolist())
    response = input_ids[prompt_len:][real[prompt_len:]].tolist()
    return prompt, response


def prefix_blocks(rows: list[tuple[tuple, list]], max_tokens: int) -> list[tuple[tuple, list[int]]]:
    """(prompt, indices of the rows whose responses follow it): rows with equal prompts share a block, which takes
    responses until the next would take it past ``max_tokens`` (then the prompt starts another block)."""
    blocks: list[tuple[tuple, list[int]]] = []
    open_block: dict[tuple, int] = {}  # prompt -> its block still taking responses
    lengths: list[int] = []
    for i, (prompt, response) in enumerate(rows):
        at = open_block.get(prompt)
        if at is None or lengths[at] + len(response) > max_tokens:
            open_block[prompt] = at = len(blocks)
            blocks.append((prompt, []))
            lengths.append(len(prompt))
        blocks[at][1].append(i)
        lengths[at] += len(response)
    return blocks


def balanced_rows(sizes: list[int], max_tokens: int) -> list[list[int]]:
    """Block indices per packed row: k = ceil(sum(sizes) / max_tokens) rows, filled largest block first into the
    row with the fewest tokens so far (so a row can pass max_tokens by less than its largest block), each row's
    blocks in their original order."""
    if not sizes:
        return []
    rows = max(1, -(-sum(sizes) // max_tokens))
    placed: list[list[int]] = [[] for _ in range(rows)]
    filled = [0] * rows
    for b in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        at = filled.index(min(filled))
        placed[at].append(b)
        filled[at] += sizes[b]
    return [sorted(row) for row in placed if row]


def pack_shared_prefix(
    input_ids: np.ndarray, attention_mask: np.ndarray, prompt_len: int, max_tokens: int = 4096, *, feed_last: bool
) -> SharedPrefixPack:
    """Pack the rows of a padded batch (see ``rlfabric.models.packed_batch.pack_sequences``) by shared prompt.

    Each block (``prefix_blocks``: a prompt and the responses that follow it) is laid out whole; the blocks are
    spread over as few rows as ``max_tokens`` allows (``balanced_rows``), which bounds the [L, L] attention per
    row, with lengths as even as possible, so padding is only what the rows' lengths leave at their ends.
    ``feed_last``: lay out each response's last token too (False for logprobs, see the module docstring).
    """
    num_rows, width = input_ids.shape
    rows = [split_padded_row(input_ids[i], attention_mask[i], prompt_len) for i in range(num_rows)]
    laid = rows if feed_last else [(prompt, response[:-1]) for prompt, response in rows]  # the input per row
    blocks = prefix_blocks(laid, max_tokens)
    sizes = [len(prompt) + sum(len(laid[i][1]) for i in members) for prompt, members in blocks]
    placed = balanced_rows(sizes, max_tokens)
    filled = [sum(sizes[b] for b in row) for row in placed]
    length = max(filled, default=0)
    shape = (len(placed), length)
    ids, positions = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
    segments, prefixes = np.full(shape, -1, np.int64), np.full(shape, -1, np.int64)
    source, row_of, column_of, target = [], [], [], []
    for g, row_blocks in enumerate(placed):
        offset, segment = 0, 0
        for b in row_blocks:
            prompt, members = blocks[b]
            p, prefix = len(prompt), segment
            span = slice(offset, offset + p)
            ids[g, span], positions[g, span], segments[g, span], prefixes[g, span] = (
                prompt,
                np.arange(p),
                prefix,
                prefix,
            )
            last_prompt_position = g * length + offset + p - 1
            offset += p
            for i in members:
                response, fed = rows[i][1], laid[i][1]
                n = len(response)
                segment += 1
                span = slice(offset, offset + len(fed))
                ids[g, span], positions[g, span] = fed, p + np.arange(len(fed))
                segments[g, span], prefixes[g, span] = segment, prefix
                # Token j of the response is predicted by the position before it: the prompt's last for j = 0.
                source += [last_prompt_position, *(g * length + offset + j for j in range(n - 1))][:n]
                row_of += [i] * n
                column_of += range(n)
                target += response
                offset += len(fed)
            segment += 1
    as_index = lambda values: np.asarray(values, np.int64)  # noqa: E731
    return SharedPrefixPack(
        ids,
        positions,
        segments,
        prefixes,
        as_index(source),
        as_index(row_of),
        as_index(column_of),
        as_index(target),
        num_rows,
        width - prompt_len,
        feed_last,
    )


def response_ends(pack: SharedPrefixPack) -> np.ndarray:
    """[N] flat index (into G * L) of each row's last response token, -1 where the response is empty. The
    response tokens sit in the packed rows in the order of ``pack.row`` (row-major: the k-th position whose segment
    is not its prefix's holds token k), so a row's last token is the largest position among its tokens. Needs a
    pack made with ``feed_last=True``."""
    if not pack.feeds_last:
        raise ValueError("response_ends: the pack leaves the responses' last tokens out (pack with feed_last=True)")
    positions = np.flatnonzero((pack.segment_ids != pack.prefix_ids).ravel())
    ends = np.full(pack.num_rows, -1, np.int64)
    np.maximum.at(ends, pack.row, positions)
    return ends


def row_budget(model: Any) -> int:
    """Tokens per packed row (and per block): the model's hidden size d. The attention over a row of L tokens
    computes every score, masked or not: 4 d L FLOPs per token and layer, against about 2 x 12 d^2 for the
    projections, so at L = d it adds about a sixth."""
    return int(model.config.hidden_size)


def projection_parameters_per_layer(model: Any) -> float:
    """Parameters of one decoder layer: the decoder's, less its token embedding, over its layers."""
    decoder = model.get_decoder()
    total = sum(p.numel() for p in decoder.parameters()) - model.get_input_embeddings().weight.numel()
    return total / max(int(model.config.num_hidden_layers), 1)


def layer_flops(row_lengths: list[int], hidden: int, parameters_per_layer: float) -> float:
    """Forward FLOPs of one decoder layer over rows of these lengths: sum over rows of 2 p L + 4 d L^2 (the
    projections, then attention scores and the weighted sum over every key of the row)."""
    return sum(2 * parameters_per_layer * n + 4 * hidden * n * n for n in row_lengths)


def cheaper_shared_prefix(
    model: Any, input_ids: np.ndarray, attention_mask: np.ndarray, prompt_len: int
) -> SharedPrefixPack | None:
    """The shared-prefix pack of the batch when it costs the model fewer FLOPs (``layer_flops``) than the
    padded rows, else None. Short responses behind a shared prompt pack well; long ones of equal length gain
    little on the projections and pay for the longer rows' attention."""
    pack = pack_shared_prefix(input_ids, attention_mask, prompt_len, row_budget(model), feed_last=False)
    hidden, parameters = int(model.config.hidden_size), projection_parameters_per_layer(model)
    rows, width = input_ids.shape
    packed = layer_flops([pack.input_ids.shape[1]] * pack.input_ids.shape[0], hidden, parameters)
    return pack if packed < layer_flops([width] * rows, hidden, parameters) else None


def shared_prefix_attention(segment_ids: torch.Tensor, prefix_ids: torch.Tensor) -> torch.Tensor:
    """Which keys each query sees, [G, 1, L, L] bool: allowed(q, k) = k <= q and s_k >= 0 and (s_k = s_q or
    s_k = p_q), with s the segment ids (a prompt or a response; -1 padding) and p_q the segment of q's prompt. A
    padding query sees itself only, so no row of the softmax is empty."""
    length = segment_ids.shape[-1]
    query, key, query_prefix = segment_ids[:, :, None], segment_ids[:, None, :], prefix_ids[:, :, None]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = causal & (key >= 0) & ((key == query) | (key == query_prefix))
    allowed |= torch.eye(length, dtype=torch.bool, device=segment_ids.device)
    return allowed[:, None]


def attention_mask_for(model: Any, allowed: torch.Tensor) -> torch.Tensor:
    """``allowed`` in the form the model's attention takes: bool for SDPA, additive float (0 or the dtype's
    minimum) for the eager implementation, which adds the mask to its scores."""
    implementation = getattr(model.config, "_attn_implementation", "sdpa")
    if implementation == "sdpa":
        return allowed
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


def maskable(model: Any) -> bool:
    """Whether the model's attention takes the shared-prefix mask."""
    return getattr(model.config, "_attn_implementation", "sdpa") in MASKABLE_ATTENTION


def check_maskable(model: Any, field: str = "learner.sequence_packing") -> None:
    """Raise a one-line error when the model's attention cannot take the shared-prefix mask."""
    implementation = getattr(model.config, "_attn_implementation", "sdpa")
    if not maskable(model):
        raise ValueError(
            f"{field} = 'shared_prefix' needs attention that takes a custom mask ({', '.join(MASKABLE_ATTENTION)}); "
            f"this model uses {implementation!r}: set {field}: padded"
        )


def response_logprobs_shared_prefix(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    matmul_dtype: str | None = None,
    max_tokens: int | None = None,
    pack: SharedPrefixPack | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [N, R] of each response token under softmax(logits / temperature) (and optionally the entropy),
    as ``response_logprobs`` gives them, computed over the shared-prefix packing of the batch (``pack``, or
    packed here with ``max_tokens``, default ``row_budget``). Columns past a row's response are 0."""
    if pack is None:
        budget = max_tokens or row_budget(model)
        pack = pack_shared_prefix(
            input_ids.cpu().numpy(), attention_mask.cpu().numpy(), prompt_len, budget, feed_last=False
        )
    device = input_ids.device
    as_tensor = lambda values: torch.from_numpy(values).to(device)  # noqa: E731
    allowed = shared_prefix_attention(as_tensor(pack.segment_ids), as_tensor(pack.prefix_ids))
    with matmul_precision(model, matmul_dtype):
        hidden = model.get_decoder()(
            input_ids=as_tensor(pack.input_ids),
            attention_mask=attention_mask_for(model, allowed),
            position_ids=as_tensor(pack.position_ids),
            use_cache=False,
        ).last_hidden_state
        picked = hidden.reshape(-1, hidden.shape[-1])[as_tensor(pack.source)]
        logits = model.get_output_embeddings()(picked).float()
    if temperature != 1.0:
        logits = logits / temperature
    where = (as_tensor(pack.row), as_tensor(pack.column))
    shape = (pack.num_rows, pack.response_width)
    picked_logp = token_logprobs_from_logits(logits, as_tensor(pack.target))
    logp = torch.zeros(shape, device=device).index_put(where, picked_logp)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(shape, device=device).index_put(where, entropy_from_logits(logits))
    return logp, entropy
