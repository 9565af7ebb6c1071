"""Every step prefix of a sample scored in one forward: the process reward model's scoring path.

A process reward model scores prompt + steps[0] + ... + steps[k] for each step k. A decoder's hidden state at a
token depends on that token and the ones before it alone (causal attention), and a sequence-classification head
reads the hidden state at a text's last token, so the score of a prefix is the head on the hidden state at the
prefix's last token *inside the whole text*: one forward over prompt + completion gives all K scores, where
scoring the prefixes one by one runs K texts whose lengths add up to about K/2 whole ones. That is exact when
every prefix tokenizes to the leading tokens of the whole text (a tokenizer may merge across a step's end: checked
per sample, as ``splits_exactly`` checks a prompt's seam), no prefix ends on the pad id and no ``max_length`` cut
applies (``prefix_ends``). The completions of a prompt that recurs (a GRPO group's) then run behind one copy of
it where that is exact and costs fewer FLOPs (``cheapest_shared_pack``); the other samples run as length-sorted
batches of ``batch_size`` right-padded rows. Samples the one-forward path cannot serve exactly, and models that
are not decoders with a ``score`` head or whose RoPE rescales with the text's length, score each prefix as a text of
its own (``score_samples``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlfabric.models.hf import STATIC_ROPE_TYPES
from rlfabric.rewards.reward_model import (
    cheapest_shared_pack,
    prompt_chunks,
    score_pack_positions,
    score_samples,
    shares_prompts,
    token_rows,
)


def reads_prefixes_off_one_forward(model: Any) -> bool:
    """A decoder with a ``score`` head (``shares_prompts``) whose positions do not depend on the text's length
    (a static RoPE: under one that rescales with the length, a prefix inside a longer text is not rotated as it is
    alone, so its score cannot be read off the whole text's forward)."""
    rotary = getattr(getattr(model, model.base_model_prefix, None), "rotary_emb", None)
    return shares_prompts(model) and getattr(rotary, "rope_type", "default") in STATIC_ROPE_TYPES


def in_chunks(flat: Sequence[Any], sizes: Sequence[int]) -> list[Any]:
    """``flat`` cut into consecutive pieces of ``sizes`` (each sample's rows of a batch scored as one)."""
    starts = np.cumsum([0, *sizes])
    return [flat[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


def prefix_ends(
    prefix_rows: Sequence[Sequence[int]], whole: Sequence[int], pad_id: int | None, max_length: int | None
) -> list[int] | None:
    """The index in ``whole`` (the whole text's tokens) of each prefix's last token, or None when reading the
    prefixes' scores off one forward over ``whole`` would not be exact: a prefix whose tokens are not the leading
    tokens of ``whole``, or that is empty or ends on ``pad_id``, or ``whole`` longer than ``max_length``."""
    if max_length is not None and len(whole) > max_length:
        return None
    ends = []
    for row in prefix_rows:
        if not row or row[-1] == pad_id or list(whole[: len(row)]) != list(row):
            return None
        ends.append(len(row) - 1)
    return ends


def score_step_prefixes(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    steps: Sequence[Sequence[str]],
    batch_size: int,
    max_length: int | None,
) -> list[np.ndarray]:
    """Per sample i, [len(steps[i]), H] float32: the scores of prompt_i + steps[i][0] + ... + steps[i][k], as
    ``score_samples`` gives each prefix scored alone (see the module docstring for how they are computed)."""
    heads = model.config.num_labels
    out = [np.zeros((len(s), heads), np.float32) for s in steps]
    wholes = token_rows(tokenizer, [p + "".join(s) for p, s in zip(prompts, steps, strict=True)])
    one_pass: dict[int, list[int]] = {}
    if reads_prefixes_off_one_forward(model):
        texts = [p + "".join(s[: k + 1]) for p, s in zip(prompts, steps, strict=True) for k in range(len(s))]
        for i, rows in enumerate(in_chunks(token_rows(tokenizer, texts), [len(s) for s in steps])):
            ends = prefix_ends(rows, wholes[i], model.config.pad_token_id, max_length)
            if ends is not None and rows:
                one_pass[i] = ends
    shared = _score_behind_shared_prompts(model, tokenizer, prompts, wholes, one_pass, batch_size, out)
    plain = [i for i in one_pass if i not in shared]
    for i, scores in zip(
        plain,
        score_row_positions(model, [wholes[i] for i in plain], [one_pass[i] for i in plain], batch_size),
        strict=True,
    ):
        out[i] = scores
    rest = [i for i in range(len(steps)) if i not in one_pass]
    if rest:
        flat = score_samples(
            model,
            tokenizer,
            [prompts[i] for i in rest for _ in steps[i]],
            ["".join(steps[i][: k + 1]) for i in rest for k in range(len(steps[i]))],
            batch_size,
            max_length,
        )
        for i, scores in zip(rest, in_chunks(flat, [len(steps[i]) for i in rest]), strict=True):
            out[i] = scores
    return out


def _score_behind_shared_prompts(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    wholes: Sequence[Sequence[int]],
    one_pass: dict[int, list[int]],
    batch_size: int,
    out: list[np.ndarray],
) -> set[int]:
    """Score the one-pass samples whose prompt recurs behind one copy of it, where the prompt tokenized alone
    leads the whole text's tokens and every prefix ends after it, and packing beats the plain rows; fills ``out``
    and returns the samples it scored."""
    counts = Counter(prompts[i] for i in one_pass)
    recurring = [i for i in one_pass if counts[prompts[i]] > 1]
    if not recurring:
        return set()
    unique = sorted({prompts[i] for i in recurring})
    prompt_ids = dict(zip(unique, token_rows(tokenizer, unique), strict=True))

    def seam_exact(i: int) -> bool:
        p = prompt_ids[prompts[i]]
        return len(p) > 0 and list(wholes[i][: len(p)]) == list(p) and one_pass[i][0] >= len(p)

    exact = [i for i in recurring if seam_exact(i)]
    done: set[int] = set()
    keys, lengths = [prompts[i] for i in exact], [len(prompt_ids[prompts[i]]) for i in exact]
    for chunk in prompt_chunks(keys, lengths, batch_size):
        members = [exact[k] for k in chunk]
        prompt_rows = [prompt_ids[prompts[i]] for i in members]
        completions = [list(wholes[i][len(p) :]) for i, p in zip(members, prompt_rows, strict=True)]
        pack = cheapest_shared_pack(model, prompt_rows, completions)
        if pack is None:
            continue
        # where each completion token sits in the packed rows: the k-th position outside its prompt holds token k
        grid = np.full((len(members), max(len(c) for c in completions)), -1, np.int64)
        grid[pack.row, pack.column] = np.flatnonzero((pack.segment_ids != pack.prefix_ids).ravel())
        positions = [grid[m, end - len(prompt_rows[m])] for m, i in enumerate(members) for end in one_pass[i]]
        scores = score_pack_positions(model, pack, np.asarray(positions, np.int64))
        for i, sample_scores in zip(members, in_chunks(scores, [len(one_pass[i]) for i in members]), strict=True):
            out[i] = sample_scores
        done.update(members)
    return done


def score_row_positions(
    model: Any, rows: Sequence[Sequence[int]], positions: Sequence[Sequence[int]], batch_size: int
) -> list[np.ndarray]:
    """Per row, [len(positions[r]), H] float32: the ``score`` head on the row's hidden states at ``positions[r]``,
    each the score of the row's tokens up to that one. Length-sorted batches of ``batch_size`` rows, each
    right-padded to its longest (padding after a token does not reach it), under ``torch.inference_mode``."""
    import torch

    from rlfabric.models.sequences import right_padded

    out = [np.zeros((len(p), model.config.num_labels), np.float32) for p in positions]
    order = np.argsort([len(row) for row in rows], kind="stable")
    device = next(model.parameters()).device
    base = getattr(model, model.base_model_prefix)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            picked = [int(r) for r in order[start : start + batch_size]]
            batch, mask = right_padded([rows[r] for r in picked], model.config.pad_token_id)
            hidden = base(input_ids=batch.to(device), attention_mask=mask.to(device), use_cache=False).last_hidden_state
            row_index = torch.tensor([b for b, r in enumerate(picked) for _ in positions[r]], device=device)
            column = torch.tensor([c for r in picked for c in positions[r]], device=device)
            scores = model.score(hidden[row_index, column]).float().cpu().numpy()
            for r, row_scores in zip(picked, in_chunks(scores, [len(positions[r]) for r in picked]), strict=True):
                out[r] = row_scores
    return out
