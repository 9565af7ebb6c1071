"""What a rollout reports to the driver: counts, per-group reward statistics and component means, packed small.

The rollout worker (``actors/llm_rollout.py``) fills a metadata dict per rollout; ``encode_meta`` packs it into
float32 buffers whose field names both sides import (``rlfabric.compact``), ``decode_meta`` reads it back on the
driver. The helpers here compute the parts every kind of rollout reports: ``group_statistics`` (what the driver
decides batching, dynamic sampling and staleness from), ``step_credit_signal``, ``episodes_meta`` for multi-turn
episodes, ``process_means``, and an evaluation's ``sums_by_source``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlfabric.agent_rollout import REFUSED_COUNTS
from rlfabric.algorithms.record_rewards import group_has_signal, step_credit_advantages
from rlfabric.compact import FloatFields
from rlfabric.tools import ERROR_KINDS
from rlfabric.trajectory import Trajectories

MAX_ERRORS_IN_META = 5
# Columns of the per-group statistics the driver reads (GROUP_STATS[:, k]).
GROUP_ID, GROUP_REWARD_MEAN, GROUP_HAS_SIGNAL, GROUP_ROWS, GROUP_MIN_VERSION = range(5)
# The metadata's numbers, as they travel to the driver (see ``encode_meta``); the counts come back as ints.
META_COUNTS = ("samples", "rows", "failed", "tokens", "reward_restarts", "record_bytes")
# What text-env episodes add (sums over a rollout's episodes); the driver logs each step's totals.
# mixed_version_episodes: episodes whose turns were sampled by more than one policy version (a weight update
# landed between their turns: a partial rollout, every token keeping its own version)
# solved_episodes, solved_tool_calls: episodes whose "correct" component is positive, and their tool calls (calls
# per solved episode: how efficiently the policy succeeds)
EPISODE_COUNTS = (
    "turns",
    "env_errors",
    "tool_calls",
    "solved_episodes",
    "solved_tool_calls",
    "mixed_version_episodes",
    *(f"invalid_tool_calls_{k}" for k in ERROR_KINDS),
)
# What outside agents' episodes (env.agent) add: calls whose history did not continue the episode's trace (each
# opened an exact segment, a row of its own) and requests the endpoint refused, by kind.
AGENT_COUNTS = ("rewrites", *REFUSED_COUNTS)
META_NUMBERS = FloatFields(
    *META_COUNTS,
    *EPISODE_COUNTS,
    *AGENT_COUNTS,
    "response_length_mean",
    "generate_time_s",
    "reward_time_s",
    "correct_sum",
    "reward_sum",
)


def group_statistics(
    group_ids: np.ndarray,
    rewards: np.ndarray,
    versions: np.ndarray,
    groups: list[int],
    step_signal: np.ndarray | None = None,
) -> np.ndarray:
    """[G, 5] float32 (the driver reads it every step: small), one row per id in ``groups``: id, mean reward, 1.0
    if its rewards differ or a row's ``step_signal`` [N] is set (signal), rows scored, oldest policy version among
    them (-1 when no row survived)."""
    out = np.zeros((len(groups), 5), np.float32)
    signal = group_has_signal(rewards, group_ids)
    if step_signal is not None:
        signal = signal | step_signal
    for k, gid in enumerate(groups):
        rows = group_ids == gid
        r = rewards[rows]
        out[k] = (gid, r.mean() if r.size else np.nan, float(signal[rows].any()), r.size, -1)
        if r.size:
            out[k, GROUP_MIN_VERSION] = versions[rows].min()
    return out


def step_credit_signal(trajectories: Trajectories, scalar: np.ndarray, spec: dict[str, Any]) -> np.ndarray | None:
    """[N] True for the rows of groups where the learner's step-level credit gives some step a nonzero advantage
    (``step_credit_advantages`` with ``spec``, ``batch_spec``'s options): such a group teaches something even when
    its outcomes are all equal. None when the record cannot take the step credit (the learner names why)."""
    if trajectories.step_spans is None or not trajectories.num_rows:
        return None
    try:
        advantages, _ = step_credit_advantages(
            trajectories,
            scalar,
            spec["reward_weights"],
            spec["step_credit"],
            spec["advantage"],
            spec["step_credit_weight"],
            spec["step_gamma"],
            spec["scale_by_std"],
            spec["process"],
        )
    except ValueError:
        return None
    step_groups = trajectories.group_id[trajectories.step_spans[:, 0]]
    return np.isin(trajectories.group_id, step_groups[advantages != 0])


def episodes_meta(
    trajectories: Trajectories,
    scalar: np.ndarray,
    versions: np.ndarray,
    sampled: list[int],
    failed: int,
    groups: list[int],
    step_signal: np.ndarray | None = None,
) -> dict[str, Any]:
    """The metadata every rollout of multi-turn episodes reports: rows of the record (the episodes that did not
    fail; an agent's rewritten history gives several), ``failed`` episodes, tokens sampled (``sampled``: per
    episode), the statistics of ``groups`` from the rows' ``scalar`` rewards and oldest ``versions``, component
    means, and the record's size. Reward services' restarts and time are 0 here: a text env's rollout that scores
    its episodes with reward functions sets them after."""
    return {
        "rows": trajectories.num_rows,
        "failed": failed,
        "tokens": int(sum(sampled)),
        "group_stats": group_statistics(trajectories.group_id, scalar, versions, groups, step_signal),
        "component_means": {k: float(v.mean()) for k, v in trajectories.final_rewards.items()}
        if trajectories.num_rows
        else {},
        "response_length_mean": float(np.mean(sampled)),
        "reward_restarts": 0,
        "record_bytes": trajectories.nbytes(),
        "reward_time_s": 0.0,
    }


def last_row_of_each_episode(episode_ids: np.ndarray) -> np.ndarray:
    """The index of each episode's last row (an agent that rewrote its history has a row per segment, each with
    the episode's rewards): sums over these count every episode once."""
    _, first_from_end = np.unique(episode_ids[::-1], return_index=True)
    return np.sort(len(episode_ids) - 1 - first_from_end)


def process_means(step_components: list[list[dict[str, float]] | None]) -> dict[str, float]:
    """Each process component's mean over rows of its mean over the row's steps (a step without it counts 0):
    what the run logs as ``reward_<component>``. Rows without step components are left out."""
    scored = [steps for steps in step_components if steps]
    names = sorted({k for steps in scored for step in steps for k in step})
    return {k: float(np.mean([np.mean([step.get(k, 0.0) for step in steps]) for steps in scored])) for k in names}


def sums_by_source(
    sources: Sequence[str], components: Sequence[Mapping[str, float] | None], rewards: Sequence[float | None]
) -> dict[str, dict[str, float]]:
    """An evaluation's sums per data source (``rlfabric.data.data_sources``), given per sample its source, its
    reward components and scalar reward (None for both where the rewards failed it): samples, scored (samples -
    failed), reward_sum, and correct_sum where some sample of the source was given a ``correct`` component."""
    out: dict[str, dict[str, float]] = {}
    for name, given, reward in zip(sources, components, rewards, strict=True):
        sums = out.setdefault(name, {"samples": 0.0, "scored": 0.0, "reward_sum": 0.0})
        sums["samples"] += 1
        if given is None or reward is None:
            continue
        sums["scored"] += 1
        sums["reward_sum"] += float(reward)
        if "correct" in given:
            sums["correct_sum"] = sums.get("correct_sum", 0.0) + float(given["correct"])
    return out


def encode_meta(meta: dict[str, Any]) -> tuple:
    """The metadata as the driver receives it: (numbers, group statistics, component names, component means,
    everything else or None). The numbers and statistics are float32 buffers; the rest (errors, shown samples,
    generator failures) is there only when something happened or was asked for."""
    numbers = {k: v for k, v in meta.items() if k in META_NUMBERS.names}
    means = meta.get("component_means", {})
    stats = meta.get("group_stats")
    rest = {
        k: v for k, v in meta.items() if k not in META_NUMBERS.names and k not in ("component_means", "group_stats")
    }
    return (
        META_NUMBERS.pack(numbers),
        None if stats is None else np.asarray(stats, np.float32).tobytes(),
        tuple(means),
        np.asarray(list(means.values()), np.float32).tobytes(),
        rest or None,
    )


def decode_meta(raw: tuple) -> dict[str, Any]:
    """``encode_meta``'s input back, as a dict."""
    numbers, stats, names, means, rest = raw
    meta: dict[str, Any] = META_NUMBERS.unpack(numbers)
    for key in (*META_COUNTS, *EPISODE_COUNTS, *AGENT_COUNTS):
        if key in meta:
            meta[key] = int(meta[key])
    if stats is not None:
        meta["group_stats"] = np.frombuffer(stats, np.float32).reshape(-1, GROUP_MIN_VERSION + 1)
    if names:
        meta["component_means"] = dict(zip(names, np.frombuffer(means, np.float32).tolist(), strict=True))
    elif stats is not None:
        meta["component_means"] = {}
    meta.update(rest or {})
    return meta
