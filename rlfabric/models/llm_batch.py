"""From trajectory records to the learner's packed batch: group selection, advantages, packing, DP padding.

Pure functions over ``Trajectories`` and numpy/torch arrays, run where the data is (in each learner and in the
reference actor), so the driver never touches the rows. Layout of the packed batch: ``pack_sequences``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rlfabric.algorithms.grpo import compute_advantages
from rlfabric.models.sequences import is_row_column, pack_sequences
from rlfabric.trajectory import Trajectories, concat, drifted_rows, sampled_version


def select_groups(trajectories: Sequence[Trajectories], groups: Sequence[int] | None) -> Trajectories:
    """The rows of ``trajectories`` (in order) whose ``group_id`` is in ``groups`` (None: every row)."""
    whole = concat(list(trajectories))
    if groups is None:
        return whole
    return whole.select(np.isin(whole.group_id, np.asarray(groups, np.int64)))


def pack_trajectories(traj: Trajectories, pad_id: int) -> dict[str, np.ndarray]:
    """The rows as one packed batch: each row's first prompt left-padded, everything after it (the response, and
    in multi-turn episodes the later turns) right-padded, with ``response_mask`` = the loss mask there and
    ``behaviour_logprobs`` the sampled tokens' logprobs (see ``rlfabric.models.sequences.pack_sequences``)."""
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


def grpo_batch(
    trajectories: Sequence[Trajectories],
    groups: Sequence[int] | None,
    *,
    pad_id: int,
    reward_weights: dict[str, float],
    advantage: str,
    scale_by_std: bool,
    overlong_filter: bool,
    world_size: int = 1,
) -> dict[str, np.ndarray]:
    """The packed GRPO batch of the chosen groups: scalar reward r = sum_c w_c * final_rewards[c], advantages by
    ``advantage`` over the groups, no loss on truncated rows with ``overlong_filter``, padded for
    ``world_size`` data-parallel learners.

    Rows that fail the trace check (``drifted_rows``: their tokens are not what the generator sampled) get no loss;
    ``batch["drifted_rows"]`` counts them and ``batch["drift_report"]`` describes the first. ``episode_id`` and
    ``sampled_version`` (``rlfabric.trajectory.sampled_version``) go along for the learner's logprob check."""
    traj = select_groups(trajectories, groups)
    rewards = torch.from_numpy(traj.total_reward(reward_weights))
    advantages = compute_advantages(advantage, rewards, torch.from_numpy(traj.group_id), scale_by_std=scale_by_std)
    batch = pack_trajectories(traj, pad_id)
    if overlong_filter:
        batch["response_mask"][traj.truncated.any(axis=1)] = 0.0
    batch["advantages"] = advantages.numpy().astype(np.float32)
    batch["episode_id"] = traj.episode_id.astype(np.int64)
    batch["sampled_version"] = sampled_version(traj)
    drifted, report = drifted_rows(traj)
    batch["response_mask"][drifted] = 0.0
    batch["advantages"][drifted] = 0.0  # no loss, so the learner may skip them like any zero-advantage row
    batch["drifted_rows"] = np.int64(drifted.sum())
    if report is not None:
        batch["drift_report"] = report
    return pad_rows_for_learners(batch, world_size)


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
