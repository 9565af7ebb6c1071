"""The scalar rewards and step advantages of trajectory records: pure numpy, no torch, so the rollout side
computes its group statistics (what the driver filters on) with the very functions the learner's batch uses
(``rlfabric.models.llm_batch.grpo_batch``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlfabric.algorithms.reward_combination import combine_rewards
from rlfabric.algorithms.step_credit import (
    STEP_TERMS,
    answer_steps,
    efficiency_penalty,
    episode_advantages,
    span_masked_advantages,
)
from rlfabric.objectives import STATE_KEYED_STEP_CREDITS, STEP_CREDITS
from rlfabric.trajectory import Trajectories


def group_has_signal(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """Dynamic sampling (DAPO): [N] True for samples whose group's rewards are not all equal (max_g != min_g).

    A group whose rewards are all equal has all-zero advantages and teaches nothing; a group of one never has signal.
    """
    groups, inverse = np.unique(np.asarray(group_ids), return_inverse=True)
    rewards = np.asarray(rewards, dtype=np.float64)
    highest = np.full(len(groups), -np.inf)
    lowest = np.full(len(groups), np.inf)
    np.maximum.at(highest, inverse, rewards)
    np.minimum.at(lowest, inverse, rewards)
    return (highest != lowest)[inverse]


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
