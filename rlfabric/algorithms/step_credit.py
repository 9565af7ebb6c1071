"""Step-level credit for multi-turn episodes, and the adaptive efficiency penalty: pure numpy, no torch, no Ray.

GRPO gives every token of an episode the episode's advantage, so a turn that helped and a turn that wasted the
episode's budget are pushed the same way. The estimators here add a per-step term, so each agent turn (one step
span of the record) gets an advantage of its own; ``step_advantages_to_tokens`` then lays them onto the tokens of
the packed batch ([N, R] per-token advantages, which the clipped loss takes as they are).

Inputs, for S steps of N rows (a record's step spans; the steps of a row in time order, as ``from_turns`` writes
them):

- ``step_rows`` [S]: the row of each step;
- ``group_ids`` [N]: the group of each row (rows compared with each other: one task's episodes);
- ``step_rewards`` [S]: r_t, the step's scalar reward (the weighted sum of its ``step_rewards`` components, with
  the weights of the scalar reward);
- ``episode_rewards`` [N]: R_i, the row's scalar reward (the one GRPO's advantage uses);
- ``state_keys`` [S]: a hashable key of the env state each step acted in (``state_key()``, see
  ``rlfabric.agent_loop``).

Standard deviations are unbiased (as ``rlfabric.algorithms.grpo.grpo_advantages``), and a group of one gets 0.
The estimators are registered by name in ``rlfabric.objectives.STEP_CREDITS`` (config ``grpo.step_credit``).

Single-turn rows cut into steps (process rewards, ``rlfabric.rewards.process``) use the same estimators: their
steps are a row's reasoning steps and its answer (the last step), r_t the process rewards of each step plus the
outcome rewards on the answer. ``span_masked_advantages`` sends the episode (outcome) term and the step (process)
term to different spans (``rewards.process.outcome_spans`` / ``process_spans``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Literal

import numpy as np

EPS = 1e-6


def _group_index(keys: Iterable[Hashable]) -> tuple[np.ndarray, int]:
    """Each key's group number (0, 1, ... in order of first appearance) and the number of groups."""
    numbers: dict[Hashable, int] = {}
    index = np.array([numbers.setdefault(k, len(numbers)) for k in keys], np.int64)
    return index, len(numbers)


def group_normalize(
    values: np.ndarray, keys: Iterable[Hashable], *, scale_by_std: bool = True, eps: float = EPS
) -> np.ndarray:
    """[M] float64: (v_j - mean_k v) / (std_k v + eps) over the entries sharing key k (std unbiased); v_j - mean_k v
    without ``scale_by_std``. A key held by one entry gives 0."""
    values = np.asarray(values, np.float64)
    index, groups = _group_index(keys)
    counts = np.bincount(index, minlength=groups).astype(np.float64)
    # The mean of v - max_k v, so entries of one key that are all equal centre to exactly 0 (as grpo_advantages).
    peaks = np.full(groups, -np.inf)
    np.maximum.at(peaks, index, values)
    shifted = values - peaks[index]
    centered = shifted - (np.bincount(index, shifted, minlength=groups) / np.maximum(counts, 1))[index]
    if not scale_by_std:
        return centered
    variance = np.bincount(index, centered**2, minlength=groups) / np.maximum(counts - 1, 1)
    return centered / (np.sqrt(variance)[index] + eps)


def discounted_step_returns(step_rows: np.ndarray, step_rewards: np.ndarray, gamma: float) -> np.ndarray:
    """[S] float64: G_t = sum_{k>=0} gamma^k r_{t+k} over the later steps of the same episode (row), i.e.
    G_t = r_t + gamma * G_{t+1}, and G_T = r_T at an episode's last step."""
    returns = np.zeros(len(step_rows), np.float64)
    later: dict[int, float] = {}  # each row's return from the step after the current one
    for s in range(len(step_rows) - 1, -1, -1):
        row = int(step_rows[s])
        returns[s] = float(step_rewards[s]) + gamma * later.get(row, 0.0)
        later[row] = returns[s]
    return returns


def episode_advantages(
    episode_rewards: np.ndarray, group_ids: np.ndarray, *, scale_by_std: bool = True, eps: float = EPS
) -> np.ndarray:
    """[N] float64, GRPO's episode advantage: A^E_i = (R_i - mean_g R) / (std_g R + eps) over the rows of row i's
    group g; A^E_i = R_i - mean_g R without ``scale_by_std`` (Dr. GRPO)."""
    return group_normalize(episode_rewards, np.asarray(group_ids).tolist(), scale_by_std=scale_by_std, eps=eps)


def gigpo_step_term(
    step_rows: np.ndarray,
    group_ids: np.ndarray,
    step_rewards: np.ndarray,
    state_keys: np.ndarray,
    *,
    gamma: float = 0.95,
    scale_by_std: bool = True,
    eps: float = EPS,
) -> np.ndarray:
    """GiGPO's step term A^S_t, [S] float64: the discounted step return G_t normalised within t's step group (the
    steps of t's group whose state key equals t's); see ``gigpo_advantages``."""
    rows = np.asarray(step_rows, np.int64)
    groups = np.asarray(group_ids, np.int64)
    returns = discounted_step_returns(rows, step_rewards, gamma)
    step_groups = [(int(g), k) for g, k in zip(groups[rows].tolist(), list(state_keys), strict=True)]
    return group_normalize(returns, step_groups, scale_by_std=scale_by_std, eps=eps)


def gigpo_advantages(
    step_rows: np.ndarray,
    group_ids: np.ndarray,
    step_rewards: np.ndarray,
    episode_rewards: np.ndarray,
    state_keys: np.ndarray,
    *,
    omega: float = 1.0,
    gamma: float = 0.95,
    scale_by_std: bool = True,
    eps: float = EPS,
) -> np.ndarray:
    """GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training"), [S] float32:

        A_t = A^E_{row(t)} + omega * A^S_t
        A^E_i = (R_i - mean_g R) / (std_g R + eps)                       (episode_advantages)
        G_t = sum_{k>=0} gamma^k r_{t+k}                                  (discounted_step_returns)
        A^S_t = (G_t - mean_{t' in sg(t)} G_t') / (std_{t' in sg(t)} G_t' + eps)   (gigpo_step_term)

    sg(t), the step group of t: the steps of the same group's episodes (any row of group g, t's own included)
    whose state key equals t's: the same env state reached in several episodes, where the turns taken from it
    are compared by what followed them. A^S_t = 0 for a step group of one (a state no other episode reached).
    Without ``scale_by_std`` both terms are centred only (Dr. GRPO style).
    """
    rows = np.asarray(step_rows, np.int64)
    a_episode = episode_advantages(episode_rewards, group_ids, scale_by_std=scale_by_std, eps=eps)
    a_step = gigpo_step_term(rows, group_ids, step_rewards, state_keys, gamma=gamma, scale_by_std=scale_by_std, eps=eps)
    return (a_episode[rows] + omega * a_step).astype(np.float32)


def step_mix_step_term(
    step_rows: np.ndarray,
    group_ids: np.ndarray,
    step_rewards: np.ndarray,
    state_keys: np.ndarray | None = None,
    *,
    gamma: float = 0.95,
    scale_by_std: bool = True,
    eps: float = EPS,
) -> np.ndarray:
    """The step + trajectory mix's step term A^T_t, [S] float64: the discounted step return G_t normalised over
    ALL steps of t's group (``state_keys`` is not read); see ``step_mix_advantages``."""
    rows = np.asarray(step_rows, np.int64)
    groups = np.asarray(group_ids, np.int64)
    returns = discounted_step_returns(rows, step_rewards, gamma)
    return group_normalize(returns, groups[rows].tolist(), scale_by_std=scale_by_std, eps=eps)


def step_mix_advantages(
    step_rows: np.ndarray,
    group_ids: np.ndarray,
    step_rewards: np.ndarray,
    episode_rewards: np.ndarray,
    state_keys: np.ndarray | None = None,
    *,
    omega: float = 1.0,
    gamma: float = 0.95,
    scale_by_std: bool = True,
    eps: float = EPS,
) -> np.ndarray:
    """Step + trajectory mix, [S] float32: A_t = A^E_{row(t)} + omega * A^T_t, with A^E as in ``gigpo_advantages``
    and A^T_t = (G_t - mean_{t' in g} G_t') / (std_{t' in g} G_t' + eps), G the discounted step return, normalised
    over ALL steps of the episodes of t's group g: no state grouping (``state_keys`` is not read), so it needs no
    state keys, and it credits a step for a return higher than the group's steps' at any point of their episodes.
    """
    rows = np.asarray(step_rows, np.int64)
    a_episode = episode_advantages(episode_rewards, group_ids, scale_by_std=scale_by_std, eps=eps)
    a_steps = step_mix_step_term(rows, group_ids, step_rewards, gamma=gamma, scale_by_std=scale_by_std, eps=eps)
    return (a_episode[rows] + omega * a_steps).astype(np.float32)


# The step terms of the shipped step credits by their grpo.step_credit names, for advantages whose two terms reach
# different spans (``span_masked_advantages``): fn(step_rows, group_ids, step_rewards, state_keys, *, gamma,
# scale_by_std) -> [S].
STEP_TERMS = {"gigpo": gigpo_step_term, "step_mix": step_mix_step_term}


def answer_steps(step_rows: np.ndarray) -> np.ndarray:
    """[S] bool: True at each row's last step, the answer span (the steps of a row in order, as producers write
    them); every other step of the row is a reasoning step."""
    rows = np.asarray(step_rows, np.int64)
    return np.append(rows[1:] != rows[:-1], True) if len(rows) else np.zeros(0, bool)


def span_masked_advantages(
    step_rows: np.ndarray,
    episode_term: np.ndarray,
    step_term: np.ndarray,
    outcome_on: np.ndarray,
    process_on: np.ndarray,
    *,
    omega: float = 1.0,
) -> np.ndarray:
    """A step credit whose two terms reach different spans (``rewards.process``), [S] float32:

        A_t = [t in O] * A^E_{row(t)} + omega * [t in P] * A^S_t

    A^E [N] the episode (outcome) term (``episode_advantages``), A^S [S] the step (process) term (``STEP_TERMS``),
    O = ``outcome_on`` and P = ``process_on`` [S] bool: the spans each term reaches (all, the answer span, the
    reasoning spans or none; ``answer_steps``). With O and P every span it is the step credit itself."""
    rows = np.asarray(step_rows, np.int64)
    episode = np.where(outcome_on, np.asarray(episode_term, np.float64)[rows], 0.0)
    return (episode + omega * np.where(process_on, step_term, 0.0)).astype(np.float32)


def step_group_share(step_rows: np.ndarray, group_ids: np.ndarray, state_keys: np.ndarray) -> float:
    """The share of steps whose step group (same group, same state key) holds more than one step: the steps
    GiGPO's step term can credit (0 when no state repeats; NaN for no steps)."""
    if len(step_rows) == 0:
        return float("nan")
    groups = np.asarray(group_ids, np.int64)[np.asarray(step_rows, np.int64)]
    index, n = _group_index(zip(groups.tolist(), list(state_keys), strict=True))
    return float((np.bincount(index, minlength=n)[index] > 1).mean())


def step_advantages_to_tokens(
    step_spans: np.ndarray, prompt_length: np.ndarray, step_advantages: np.ndarray, width: int
) -> np.ndarray:
    """[N, width] float32 per-token advantages in the packed batch's response layout (``pack_trajectories``: row
    i's response column j is its record position prompt_length[i] + j): A[i, start - P_i : end - P_i] = A_s for
    each step span s = (i, start, end); 0 on every token outside a span (observations, padding)."""
    out = np.zeros((len(prompt_length), width), np.float32)
    for (row, start, end), advantage in zip(np.asarray(step_spans).tolist(), step_advantages, strict=True):
        offset = int(prompt_length[row])
        out[row, start - offset : end - offset] = advantage
    return out


def efficiency_penalty(
    counts: np.ndarray,
    success: np.ndarray,
    group_ids: np.ndarray,
    *,
    weight: float,
    apply: Literal["on_success", "always"] = "on_success",
) -> np.ndarray:
    """Adaptive efficiency penalty, [N] float32, added to the scalar reward before advantages:

        penalty_i = -weight * max(0, c_i - m_g) / max(m_g, 1)

    c_i: row i's call count; m_g: the median call count of the successful rows (success_i > 0) of i's group g,
    or of all of g's rows when none succeeded (the median of an even number of counts is the mean of the middle
    two). So the bar is what the group's own successes needed: calls beyond it cost in proportion to it, and no
    fixed budget has to be tuned per task. ``apply``: "on_success" penalises successful rows only (a failure is
    not made worse for trying), "always" every row.
    """
    if apply not in ("on_success", "always"):
        raise ValueError(f"apply = {apply!r}: expected 'on_success' or 'always'")
    counts = np.asarray(counts, np.float64)
    succeeded = np.asarray(success) > 0
    groups = np.asarray(group_ids, np.int64)
    penalty = np.zeros(len(counts), np.float64)
    for g in np.unique(groups):
        rows = groups == g
        bar_rows = rows & succeeded if (rows & succeeded).any() else rows
        median = float(np.median(counts[bar_rows]))
        penalty[rows] = -weight * np.maximum(0.0, counts[rows] - median) / max(median, 1.0)
    if apply == "on_success":
        penalty[~succeeded] = 0.0
    return penalty.astype(np.float32)
