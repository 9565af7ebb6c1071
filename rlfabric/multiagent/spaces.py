"""What rlfabric does with a multi-agent env's per-agent spaces: the flat observation a policy sees, the action head
it samples from, and the action mask it obeys.

PettingZoo games put legal moves in a Dict observation, ``{"observation": ..., "action_mask": ...}`` (every classic
game does): the mask is split off and reaches the sampler and the learner, the rest is flattened. Any other space
Gymnasium can flatten (Box, Discrete, MultiBinary, nested Dict/Tuple of those) is flattened to float32; action spaces
must be Discrete or a 1-d Box (``rlfabric.models.ActionSpec``). Anything else is refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from rlfabric.models import ActionSpec

MASK_KEYS = ("action_mask",)
OBS_KEYS = ("observation", "obs")


class UnsupportedSpaceError(ValueError):
    """A space rlfabric's policies cannot use; the message names the agent, the space and why."""


@dataclass(frozen=True)
class AgentSpaces:
    """One agent's spaces as a policy sees them.

    ``obs_dim``: length of the flat float32 observation. ``action``: the policy head. ``mask_key``: the key of the
    action mask in a Dict observation (None: every action is always legal). ``obs_key``: the key of the observation
    proper beside the mask (None: the whole observation). ``notes``: what was done, for ``rlfabric envs check``.
    """

    obs_space: gym.Space
    obs_dim: int
    action: ActionSpec
    mask_key: str | None = None
    obs_key: str | None = None
    notes: tuple[str, ...] = ()

    def encode(self, obs: Any) -> tuple[np.ndarray, np.ndarray | None]:
        """(flat float32 observation [obs_dim], bool action mask [action.n] or None) for one raw observation."""
        if self.mask_key is None:
            return _flat(self.obs_space, obs), None
        mask = np.asarray(obs[self.mask_key]).astype(bool).reshape(-1)
        inner = obs[self.obs_key] if self.obs_key is not None else {k: v for k, v in obs.items() if k != self.mask_key}
        return _flat(self._inner_space, inner), mask

    @property
    def _inner_space(self) -> gym.Space:
        assert isinstance(self.obs_space, gym.spaces.Dict)
        if self.obs_key is not None:
            return self.obs_space[self.obs_key]
        return gym.spaces.Dict({k: s for k, s in self.obs_space.spaces.items() if k != self.mask_key})

    def same_as(self, other: AgentSpaces) -> bool:
        """Whether one policy can act for both agents: same observation size, action head and masking."""
        mine = (self.obs_dim, self.action, self.mask_key is None)
        return mine == (other.obs_dim, other.action, other.mask_key is None)


def _flat(space: gym.Space, obs: Any) -> np.ndarray:
    if isinstance(space, gym.spaces.Box):
        return np.asarray(obs, np.float32).reshape(-1)
    return np.asarray(gym.spaces.flatten(space, obs), np.float32)


def _flat_dim(space: gym.Space, agent: str) -> tuple[int, str | None]:
    """(flat size, a note when flattening changed the shape) or UnsupportedSpaceError."""
    if isinstance(space, gym.spaces.Box):
        size = int(np.prod(space.shape))
        return size, None if len(space.shape) == 1 else f"observation {space} flattened to {size} values"
    try:
        size = int(gym.spaces.flatdim(space))
    except (NotImplementedError, ValueError, TypeError) as exc:
        raise UnsupportedSpaceError(
            f"agent {agent!r}: observation space {space} cannot be flattened ({exc.__class__.__name__}); wrap the env "
            "so it observes a Box or a Dict/Tuple of Box, Discrete and MultiBinary"
        ) from None
    if _text_part(space) is not None:  # gymnasium writes text as character indices, which a net reads as amounts
        return size, (
            f"observation {space} flattened to {size} values, its text as character indices (not one-hot): a "
            "neural policy reads them as amounts; wrap the env, or give the agent a language-model policy (kind: llm)"
        )
    return size, f"observation {space} flattened (one-hot for discrete parts) to {size} values"


def _text_part(space: gym.Space) -> gym.spaces.Text | None:
    """The first ``Text`` space in ``space`` (itself, or nested in a Dict or Tuple), or None."""
    if isinstance(space, gym.spaces.Text):
        return space
    parts = space.spaces.values() if isinstance(space, gym.spaces.Dict) else getattr(space, "spaces", ())
    if isinstance(space, gym.spaces.Dict | gym.spaces.Tuple):
        return next((t for t in map(_text_part, parts) if t is not None), None)
    return None


def agent_spaces(obs_space: gym.Space, action_space: gym.Space, agent: str = "") -> AgentSpaces:
    """How a policy acts for an agent with these spaces, or UnsupportedSpaceError naming the agent and the reason."""
    try:
        action = ActionSpec.from_space(action_space)
    except ValueError as exc:
        raise UnsupportedSpaceError(f"agent {agent!r}: {exc}") from None
    notes: list[str] = []
    mask_key = obs_key = None
    inner: gym.Space = obs_space
    if isinstance(obs_space, gym.spaces.Dict):
        mask_key = next((k for k in MASK_KEYS if k in obs_space.spaces), None)
    if mask_key is not None:
        mask_space = obs_space[mask_key]
        size = int(np.prod(getattr(mask_space, "shape", ()) or (0,)))
        if action.kind != "discrete" or size != action.n:
            raise UnsupportedSpaceError(
                f"agent {agent!r}: action mask {mask_key!r} of {size} entries does not match action space "
                f"{action_space} (a mask needs a Discrete action space of the same size)"
            )
        rest = [k for k in obs_space.spaces if k != mask_key]
        obs_key = rest[0] if len(rest) == 1 else next((k for k in OBS_KEYS if k in rest), None)
        inner = obs_space[obs_key] if obs_key is not None else gym.spaces.Dict({k: obs_space[k] for k in rest})
        notes.append(f"action mask found under {mask_key!r}: masked actions get zero probability")
    dim, note = _flat_dim(inner, agent)
    if note:
        notes.append(note)
    if action.kind == "continuous":
        notes.append(f"continuous actions: Gaussian policy over {action.n} dims, clipped to the space's bounds")
    else:
        notes.append(f"discrete actions: categorical policy over {action.n} actions")
    return AgentSpaces(obs_space, dim, action, mask_key, obs_key, tuple(notes))
