"""Named reward components of a Gymnasium env's step ``info``, and the reward PPO trains on when they are weighted.

Gymnasium's MuJoCo envs (and users' envs) report the terms of their reward in ``info``: HalfCheetah's
``reward_forward`` and ``reward_ctrl`` sum to its reward. ``env.reward_components`` names the keys a PPO run reads
(logged per episode as ``episode_reward_<key>`` and kept in the trajectory record as components beside ``env``);
``env.reward_weights`` reweights them (``shaped_reward``). Nothing here imports Ray or torch.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# The name of the env's own reward in the trajectory record (``Trajectories.rewards``): no component may take it.
ENV_REWARD = "env"


def components_read(reward_components: Sequence[str], reward_weights: Mapping[str, float]) -> tuple[str, ...]:
    """The info keys a run reads: ``reward_components``, then each key of ``reward_weights`` not among them (a
    weighted key is read, logged and recorded like a listed one)."""
    names = list(reward_components)
    names += [k for k in reward_weights if k not in names]
    return tuple(names)


def component_metric(key: str) -> str:
    """The metrics column of an info key's per-episode sum: ``episode_reward_<key>``, a leading ``reward_`` of the
    key left out (``reward_forward`` -> ``episode_reward_forward``, ``safety`` -> ``episode_reward_safety``)."""
    return "episode_reward_" + key.removeprefix("reward_")


def shaped_reward(
    env_reward: np.ndarray, components: Mapping[str, np.ndarray], weights: Mapping[str, float]
) -> np.ndarray:
    """The reward PPO trains on: r' = r + sum_k (w_k - 1) * c_k, over the keys k of ``weights``.

    ``env_reward`` is the env's own reward r; ``components[k]`` the info value c_k at the same steps (same shape);
    ``weights[k]`` is w_k. With r = sum_k c_k + rest (as a MuJoCo env's reward is), r' = sum_k w_k c_k + rest:
    each weighted term counts w_k times, w_k = 1 leaves r as it is, w_k = 0 takes the term out. No weights: r
    itself (the same array). float32 like the record's rewards.
    """
    if not weights:
        return env_reward
    out = np.asarray(env_reward, np.float64).copy()
    for key, weight in weights.items():
        if weight != 1.0:
            out += (float(weight) - 1.0) * np.asarray(components[key], np.float64)
    return out.astype(np.float32)


class MissingRewardComponent(ValueError):
    """A step's ``info`` lacks a key the run reads (``env.reward_components`` / ``env.reward_weights``): the config
    and the env disagree, so the run stops at once rather than replacing runners that would fail the same way."""


def missing_component(env_id: str, key: str, info: Mapping[str, Any]) -> MissingRewardComponent:
    """The one line for a step whose ``info`` has no ``key``: the key, and the keys the env gave."""
    return MissingRewardComponent(f"env {env_id!r} {missing_component_words(key, info)}")


def missing_component_words(key: str, info: Mapping[str, Any]) -> str:
    """'gave no <key> in its step info, ...': which key, a close match among the keys given, and those keys."""
    keys = sorted((k for k in info if isinstance(k, str)), key=str)
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.8)  # a typo, not any key sharing "reward_"
    given = ", ".join(repr(k) for k in sorted(info, key=str)) or "none"
    return (
        f"gave no {key!r} in its step info, which env.reward_components / env.reward_weights name; "
        + (f"did you mean {close[0]!r}? " if close else "")
        + f"the keys it gave: {given}"
    )
