"""Columnar numpy batches from token rows and trajectory records, for learners, SFT and the rollout side.

Layout (``pack_sequences``): each row is the prompt LEFT-padded to the batch's longest prompt P, then the response
RIGHT-padded to R, so every response starts at column P. No torch here: rollout workers build SFT batches and
group statistics without importing it (``rlfabric.models.sequences`` runs the model over these batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rlfabric.trajectory import Trajectories, concat


def pack_sequences(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int
) -> dict[str, np.ndarray]:
    """Columnar batch: input_ids and attention_mask [N, P + R], response_mask [N, R], prompt_len P."""
    if len(prompts) != len(responses):
        raise ValueError(f"pack_sequences: {len(prompts)} prompts but {len(responses)} responses")
    n = len(prompts)
    width_p = max((len(p) for p in prompts), default=0)
    width_r = max((len(r) for r in responses), default=0)
    input_ids = np.full((n, width_p + width_r), pad_id, dtype=np.int64)
    attention = np.zeros((n, width_p + width_r), dtype=np.int64)
    response_mask = np.zeros((n, width_r), dtype=np.float32)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=False)):
        input_ids[i, width_p - len(p) : width_p] = p
        input_ids[i, width_p : width_p + len(r)] = r
        attention[i, width_p - len(p) : width_p + len(r)] = 1
        response_mask[i, : len(r)] = 1.0
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "response_mask": response_mask,
        "prompt_len": np.int64(width_p),
    }


def is_row_column(value: Any, num_rows: int) -> bool:
    """Whether a batch entry holds one value per row (and so is sliced, padded and sharded with the rows)."""
    return getattr(value, "ndim", 0) >= 1 and len(value) == num_rows  # numpy arrays and torch tensors


def select_groups(trajectories: Sequence[Trajectories], groups: Sequence[int] | None) -> Trajectories:
    """The rows of ``trajectories`` (in order) whose ``group_id`` is in ``groups`` (None: every row)."""
    whole = concat(list(trajectories))
    if groups is None:
        return whole
    return whole.select(np.isin(whole.group_id, np.asarray(groups, np.int64)))


def pack_trajectories(traj: Trajectories, pad_id: int) -> dict[str, np.ndarray]:
    """The rows as one packed batch: each row's first prompt left-padded, everything after it (the response, and
    in multi-turn episodes the later turns) right-padded, with ``response_mask`` = the loss mask there and
    ``behaviour_logprobs`` the sampled tokens' logprobs (see ``pack_sequences``)."""
    n = traj.num_rows
    prompts = [traj.prompt(i) for i in range(n)]
    spans = [traj.completion(i) for i in range(n)]
    assert traj.tokens is not None
    responses = [traj.tokens[i, s] for i, s in enumerate(spans)]
    batch = pack_sequences(prompts, responses, pad_id)
    behaviour = np.zeros_like(batch["response_mask"])
    mask = np.zeros_like(batch["response_mask"])
    for i, s in enumerate(spans):
        width = s.stop - s.start
        behaviour[i, :width] = traj.logprobs[i, s]
        mask[i, :width] = traj.loss_mask[i, s]
    batch["response_mask"] = mask
    batch["behaviour_logprobs"] = behaviour
    return batch


def pad_rows_for_learners(batch: dict[str, np.ndarray], world_size: int) -> dict[str, np.ndarray]:
    """Repeat rows with a zero loss mask until ``world_size`` data-parallel learners get the same number each."""
    n = len(batch["input_ids"])
    extra = (-n) % world_size
    if extra == 0:
        return batch
    out = dict(batch)
    repeat = np.arange(extra) % max(n, 1)
    for key, value in batch.items():
        if is_row_column(value, n):
            pad = value[repeat].copy()
            if key == "response_mask":
                pad[:] = 0.0
            out[key] = np.concatenate([value, pad])
    return out
