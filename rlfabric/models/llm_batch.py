"""From trajectory records to the learner's packed batch: group selection, advantages, packing, DP padding.

Pure functions over ``Trajectories`` and numpy/torch arrays, run where the data is (in each learner and in the
reference actor), so the driver never touches the rows. Layout of the packed batch: ``pack_sequences``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rlfabric.algorithms.grpo import compute_advantages
from rlfabric.algorithms.reward_combination import combine_rewards
from rlfabric.algorithms.step_credit import (
    STEP_TERMS,
    answer_steps,
    efficiency_penalty,
    episode_advantages,
    span_masked_advantages,
    step_advantages_to_tokens,
    step_group_share,
)
from rlfabric.models.sequences import is_row_column, pack_sequences
from rlfabric.objectives import NO_STEP_CREDIT, STATE_KEYED_STEP_CREDITS, STEP_CREDITS
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
    ``batch["efficiency_penalty"]`` (the rows' mean penalty) and ``batch["step_group_share"]`` (gigpo: the share
    of steps in a step group of more than one) are scalars for the learner's metrics."""
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
        batch["response_mask"][traj.truncated.any(axis=1)] = 0.0
    batch["episode_id"] = traj.episode_id.astype(np.int64)
    batch["sampled_version"] = sampled_version(traj)
    drifted, report = drifted_rows(traj)
    batch["response_mask"][drifted] = 0.0
    batch["advantages"][drifted] = 0.0  # no loss, so the learner may skip them like any zero-advantage row
    batch["drifted_rows"] = np.int64(drifted.sum())
    if report is not None:
        batch["drift_report"] = report
    return pad_rows_for_learners(batch, world_size)


def combined_rewards(
    traj: Trajectories, reward_weights: dict[str, float], combine: dict[str, Any] | None = None
) -> np.ndarray:
    """[N] the rows' final reward components combined (``rewards.combine``: clip, gate, MO-GRPO normalization
    within each group, then the weighted sum; ``rlfabric.algorithms.reward_combination``). Without clips, gates or
    normalization it is the weighted sum sum_c w_c * final_rewards[c]."""
    c = combine or {}
    if not (c.get("normalize") or c.get("clip") or c.get("gates")):
        return traj.total_reward(reward_weights)
    clip = {name: (float(low), float(high)) for name, (low, high) in c.get("clip", {}).items()}
    return combine_rewards(
        traj.final_rewards,
        traj.group_id,
        reward_weights,
        clip=clip,
        gates=c.get("gates"),
        normalize=c.get("normalize", False),
    )


def outcome_rewards(
    traj: Trajectories,
    reward_weights: dict[str, float],
    combine: dict[str, Any] | None = None,
    efficiency: dict[str, Any] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """([N] the scalar reward advantages use, [N] its efficiency penalty or None): ``combined_rewards`` plus the
    efficiency penalty when ``efficiency["weight"]`` > 0. The learner's batch and the rollout side's group
    statistics (what the driver filters on) both take it from here."""
    rewards = combined_rewards(traj, reward_weights, combine)
    if efficiency is None or efficiency.get("weight", 0.0) <= 0:
        return rewards, None
    penalty = efficiency_rewards(traj, efficiency)
    return rewards + penalty, penalty


def efficiency_rewards(traj: Trajectories, efficiency: dict[str, Any]) -> np.ndarray:
    """[N] the efficiency penalty of each row (``rlfabric.algorithms.step_credit.efficiency_penalty``): c_i is the
    sum of the ``efficiency["counts"]`` components of ``final_rewards``, success the ``efficiency["success"]``
    component (a component the record lacks is 0 for every row: none of them earned it)."""
    zeros = np.zeros(traj.num_rows, np.float32)
    counts = sum((traj.final_rewards.get(name, zeros) for name in efficiency["counts"]), zeros)
    success = traj.final_rewards.get(efficiency.get("success", "correct"), zeros)
    return efficiency_penalty(
        counts, success, traj.group_id, weight=float(efficiency["weight"]), apply=efficiency.get("apply", "on_success")
    )


def step_credit_advantages(
    traj: Trajectories,
    rewards: np.ndarray,
    reward_weights: dict[str, float],
    step_credit: str,
    advantage: str,
    omega: float,
    gamma: float,
    scale_by_std: bool,
    process: dict[str, Any] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """([S] per-step advantages, [S] bool: the steps that get any of it) by the step credit's name
    (``rlfabric.objectives.STEP_CREDITS``): episode rewards ``rewards`` [N], step rewards weighted by
    ``reward_weights``, the record's state keys. With ``process`` (``rewards.process``) sending the episode
    (outcome) term and the step (process) term to some spans only, ``span_masked_advantages`` of the two terms
    (``STEP_TERMS``; the answer span is each row's last step). A ValueError in one line naming the field when the
    record or the step credit cannot give what is asked."""
    if advantage != "grpo":
        raise ValueError(
            f"grpo.step_credit = {step_credit!r} needs grpo.advantage 'grpo' (its episode term), not {advantage!r}"
        )
    if step_credit in STATE_KEYED_STEP_CREDITS and traj.state_keys is None:
        raise ValueError(
            f"grpo.step_credit = {step_credit!r} needs state keys in the trajectory record and it has none: the "
            "text env has no state_key() method (see rlfabric.agent_loop); use 'step_mix' or 'none'"
        )
    if traj.step_spans is None:
        raise ValueError(f"grpo.step_credit = {step_credit!r} needs step spans in the trajectory record")
    rows = traj.step_spans[:, 0]
    state_keys = traj.state_keys
    if state_keys is None:
        state_keys = np.full(len(rows), None, dtype=object)
    step_rewards = traj.step_total_reward(reward_weights)
    every = np.ones(len(rows), bool)
    spans = (process or {}).get("outcome_spans", "all"), (process or {}).get("process_spans", "all")
    if spans == ("all", "all"):
        credit = STEP_CREDITS.resolve(step_credit)
        return credit(
            rows, traj.group_id, step_rewards, rewards, state_keys, omega=omega, gamma=gamma, scale_by_std=scale_by_std
        ), every
    if step_credit not in STEP_TERMS:
        raise ValueError(
            f"rewards.process.outcome_spans/process_spans need a step credit with a separate step term "
            f"({', '.join(STEP_TERMS)}), not grpo.step_credit = {step_credit!r}"
        )
    answer = answer_steps(rows)
    outcome_on = {"all": every, "answer": answer, "none": ~every}[spans[0]]
    process_on = {"all": every, "reasoning": ~answer, "none": ~every}[spans[1]]
    step_term = STEP_TERMS[step_credit](
        rows, traj.group_id, step_rewards, state_keys, gamma=gamma, scale_by_std=scale_by_std
    )
    episode_term = episode_advantages(rewards, traj.group_id, scale_by_std=scale_by_std)
    advantages = span_masked_advantages(rows, episode_term, step_term, outcome_on, process_on, omega=omega)
    return advantages, outcome_on | process_on


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
