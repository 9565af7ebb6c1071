"""From trajectory records to the learner's packed batch: the GRPO batch of the chosen groups, with advantages.

Pure functions over ``Trajectories`` and numpy/torch arrays, run where the data is (in each learner and in the
reference actor), so the driver never touches the rows. The torch-free parts the rollout side also runs live in
``rlfabric.models.packed_batch`` (packing) and ``rlfabric.algorithms.record_rewards`` (rewards, step credit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rlfabric.algorithms.grpo import compute_advantages
from rlfabric.algorithms.record_rewards import outcome_rewards, step_credit_advantages
from rlfabric.algorithms.step_credit import step_advantages_to_tokens, step_group_share
from rlfabric.models.packed_batch import pack_trajectories, pad_rows_for_learners, select_groups
from rlfabric.objectives import NO_STEP_CREDIT, STATE_KEYED_STEP_CREDITS
from rlfabric.trajectory import Trajectories, drifted_rows, sampled_version


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
    step_credit: str = NO_STEP_CREDIT,
    step_credit_weight: float = 1.0,
    step_gamma: float = 0.95,
    efficiency: dict[str, Any] | None = None,
    combine: dict[str, Any] | None = None,
    process: dict[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """The packed GRPO batch of the chosen groups: the scalar reward of ``outcome_rewards`` (the components
    combined as ``combine`` says, plus the efficiency penalty), advantages by ``advantage``
    over the groups, no loss on truncated rows with ``overlong_filter``, padded for ``world_size`` data-parallel
    learners.

    ``advantages`` is [N] (one per row) with ``step_credit`` "none", else [N, R] per token: each step span's tokens
    get its step's advantage (``rlfabric.objectives.STEP_CREDITS``, omega ``step_credit_weight``, gamma
    ``step_gamma``; step rewards weighted like the scalar reward), every other token 0. ``process``
    (``rewards.process``) may send the advantage's episode (outcome) term and step (process) term to different
    spans (``step_credit_advantages``); a span that gets neither has no loss.

    Rows that fail the trace check (``drifted_rows``: their tokens are not what the generator sampled) get no loss;
    ``batch["drifted_rows"]`` counts them and ``batch["drift_report"]`` describes the first. ``episode_id`` and
    ``sampled_version`` (``rlfabric.trajectory.sampled_version``) go along for the learner's logprob check.
    ``batch["efficiency_penalty"]`` (the rows' mean penalty), ``batch["step_group_share"]`` (gigpo: the share
    of steps in a step group of more than one) and ``batch["overlong_filtered"]`` (the rows the filter took out)
    are scalars for the learner's metrics."""
    traj = select_groups(trajectories, groups)
    batch = pack_trajectories(traj, pad_id)
    rewards, penalty = outcome_rewards(traj, reward_weights, combine, efficiency)
    if penalty is not None:
        batch["efficiency_penalty"] = np.float32(penalty.mean() if len(penalty) else 0.0)
    if step_credit == NO_STEP_CREDIT:
        advantages = compute_advantages(  # group ids copied: a record read from the object store is read-only
            advantage, torch.from_numpy(rewards), torch.tensor(traj.group_id), scale_by_std=scale_by_std
        )
        batch["advantages"] = advantages.numpy().astype(np.float32)
    else:
        step_advantages, trained = step_credit_advantages(
            traj, rewards, reward_weights, step_credit, advantage, step_credit_weight, step_gamma, scale_by_std, process
        )
        assert traj.prompt_length is not None and traj.step_spans is not None
        width = batch["response_mask"].shape[1]
        batch["advantages"] = step_advantages_to_tokens(traj.step_spans, traj.prompt_length, step_advantages, width)
        if not trained.all():  # spans neither term reaches: no loss there
            untrained = step_advantages_to_tokens(traj.step_spans, traj.prompt_length, (~trained).astype(float), width)
            batch["response_mask"][untrained > 0] = 0.0
        if step_credit in STATE_KEYED_STEP_CREDITS:
            assert traj.state_keys is not None
            batch["step_group_share"] = np.float32(
                step_group_share(traj.step_spans[:, 0], traj.group_id, traj.state_keys)
            )
    if overlong_filter:
        cut = traj.truncated.any(axis=1)
        batch["response_mask"][cut] = 0.0
        batch["overlong_filtered"] = np.int64(cut.sum())
    batch["episode_id"] = traj.episode_id.astype(np.int64)
    batch["sampled_version"] = sampled_version(traj)
    drifted, report = drifted_rows(traj)
    batch["response_mask"][drifted] = 0.0
    batch["advantages"][drifted] = 0.0  # no loss, so the learner may skip them like any zero-advantage row
    batch["drifted_rows"] = np.int64(drifted.sum())
    if report is not None:
        batch["drift_report"] = report
    return pad_rows_for_learners(batch, world_size)
