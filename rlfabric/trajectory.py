"""The trajectory record: the one thing rollouts produce and learners consume, for every kind of env.

``Trajectories`` is columnar. A **row** is one agent's contiguous segment of one episode: an LLM episode (prompt
and response tokens, later several turns with tool tokens between them), or one env's fragment of T steps in
classic RL. A **position** is a token (LLM) or an env step (classic RL). Per-position columns are ``[N, L]``
arrays, right-padded past ``length[i]``; per-row columns are ``[N]``. Every field, its shape and who fills it:
docs/trajectories.md.

The record lives in Ray's object store: producers return it as an ObjectRef next to small metadata, and learners
``ray.get`` it (zero-copy for the numpy columns on one node). Nothing here imports Ray or torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

NO_VERSION = -1  # policy_version of positions no policy produced: prompt, tool and env tokens, padding
NO_GROUP = -1

# Columns with one entry per row / per position; the reward dicts and step spans are handled by name below.
ROW_COLUMNS = (
    "episode_id",
    "group_id",
    "agent_id",
    "policy_id",
    "length",
    "prompt_length",
    "bootstrap_obs",
    "bootstrap_critic_obs",
)
POSITION_COLUMNS = (
    "loss_mask",
    "policy_version",
    "logprobs",
    "terminated",
    "truncated",
    "tokens",
    "sampled_tokens",
    "obs",
    "actions",
    "values",
    "action_mask",
    "critic_obs",
)


@dataclass
class Trajectories:
    """A batch of trajectory rows (see the module docstring and docs/trajectories.md)."""

    # -- per row [N] --
    episode_id: np.ndarray  # int64: unique within a run
    group_id: np.ndarray  # int64: rows compared with each other (a GRPO group, one prompt's samples); -1: none
    agent_id: np.ndarray  # str: the agent that acted ("agent_0" in single-agent envs)
    policy_id: np.ndarray  # str: the policy that acted for it ("default")
    length: np.ndarray  # int32: positions used in this row; the rest is padding
    # -- per position [N, L] --
    loss_mask: np.ndarray  # float32: 1 where the learner's loss counts (model tokens, agent steps), else 0
    policy_version: np.ndarray  # int32: the policy version that produced each position; -1 where none did
    logprobs: np.ndarray  # float32: behaviour log-probability of each produced token/action; 0 elsewhere
    terminated: np.ndarray  # bool: the episode ended at this position (no bootstrap)
    truncated: np.ndarray  # bool: the episode was cut at this position (bootstrap from the next observation)
    # -- token sequences (LLM envs) --
    tokens: np.ndarray | None = None  # int32 [N, L]: prompt, then response (and tool/env tokens), as sampled
    # int32 [N, L]: the generator's sampled ids, placed where the producer put each turn; -1 elsewhere. The trace
    # check (``drifted_rows``) compares them with ``tokens``: a producer that rebuilt ``tokens`` some other way
    # (re-tokenizing the chat) is caught on arrival.
    sampled_tokens: np.ndarray | None = None
    prompt_length: np.ndarray | None = None  # int32 [N]: the first prompt's tokens at the start of each row
    # -- observations and actions (classic envs) --
    obs: np.ndarray | None = None  # float32 [N, L, D]: what the policy saw (normalized when normalizing)
    actions: np.ndarray | None = None  # [N, L] int64 (discrete) or [N, L, A] float32 (continuous)
    values: np.ndarray | None = None  # float32 [N, L]: the critic's values, where the producer has them
    bootstrap_obs: np.ndarray | None = None  # float32 [N, D]: the observation after each row's last position
    truncation_index: np.ndarray | None = None  # int64 [K, 2]: (row, position) of truncations inside rows
    truncation_obs: np.ndarray | None = None  # float32 [K, D]: the final observation at each of those
    # -- multi-agent games --
    action_mask: np.ndarray | None = None  # bool [N, L, A]: the legal actions at each step (masked ones never sampled)
    # float32 [N, L, G]: what a centralized critic sees at each step (global state and the agent's one-hot); None:
    # the critic sees ``obs``. Its bootstrap and truncation counterparts follow ``bootstrap_obs`` / ``truncation_obs``.
    critic_obs: np.ndarray | None = None
    bootstrap_critic_obs: np.ndarray | None = None  # float32 [N, G]
    truncation_critic_obs: np.ndarray | None = None  # float32 [K, G]
    # -- rewards, by named component --
    rewards: dict[str, np.ndarray] = field(default_factory=dict)  # float32 [N, L]: received at each position
    final_rewards: dict[str, np.ndarray] = field(default_factory=dict)  # float32 [N]: outcome of the row
    step_spans: np.ndarray | None = None  # int32 [S, 3]: (row, start, end) per agent turn / reasoning step
    step_rewards: dict[str, np.ndarray] = field(default_factory=dict)  # float32 [S]: per step span
    state_keys: np.ndarray | None = None  # object [S]: hashable env-state key per step span (step grouping)
    extras: dict[str, Any] = field(default_factory=dict)  # small producer data (e.g. normalizer statistics)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_rows(self) -> int:
        return len(self.episode_id)

    @property
    def width(self) -> int:
        """L: positions per row including padding."""
        return self.loss_mask.shape[1] if self.loss_mask.ndim == 2 else 0

    @property
    def within_length(self) -> np.ndarray:
        """[N, L] bool: the positions before each row's ``length`` (the rest is padding)."""
        return np.arange(self.width)[None, :] < self.length[:, None]

    def validate(self) -> None:
        """Raise ValueError naming the first column whose shape does not fit the record."""
        n, width = self.num_rows, self.width
        for name in ROW_COLUMNS:
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"Trajectories.{name}: {len(value)} rows, expected {n}")
        for name in POSITION_COLUMNS:
            value = getattr(self, name)
            if value is not None and tuple(value.shape[:2]) != (n, width):
                raise ValueError(f"Trajectories.{name}: shape {tuple(value.shape)}, expected ({n}, {width}, ...)")
        for name, value in self.rewards.items():
            if value.shape != (n, width):
                raise ValueError(f"Trajectories.rewards[{name!r}]: shape {value.shape}, expected ({n}, {width})")
        for name, value in self.final_rewards.items():
            if value.shape != (n,):
                raise ValueError(f"Trajectories.final_rewards[{name!r}]: shape {value.shape}, expected ({n},)")
        spans = 0 if self.step_spans is None else len(self.step_spans)
        for name, value in self.step_rewards.items():
            if value.shape != (spans,):
                raise ValueError(f"Trajectories.step_rewards[{name!r}]: shape {value.shape}, expected ({spans},)")
        if self.state_keys is not None and self.state_keys.shape != (spans,):
            raise ValueError(f"Trajectories.state_keys: shape {self.state_keys.shape}, expected ({spans},)")
        if self.length.size and (self.length.max() > width or self.length.min() < 0):
            raise ValueError(f"Trajectories.length: values must lie in [0, {width}]")

    def nbytes(self) -> int:
        """Bytes of the record's arrays (what moves through the object store, give or take pickling)."""
        total = 0
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, np.ndarray):
                total += value.nbytes
            elif isinstance(value, dict):
                total += sum(v.nbytes for v in value.values() if isinstance(v, np.ndarray))
        return total

    # -- token sequences ----------------------------------------------------------------------------------

    def prompt(self, row: int) -> np.ndarray:
        """Row ``row``'s prompt token ids."""
        assert self.tokens is not None and self.prompt_length is not None
        return self.tokens[row, : self.prompt_length[row]]

    def completion(self, row: int) -> slice:
        """The positions after the prompt: the response (and later turns) of row ``row``."""
        assert self.prompt_length is not None
        return slice(int(self.prompt_length[row]), int(self.length[row]))

    def total_reward(self, weights: dict[str, float]) -> np.ndarray:
        """[N] scalar outcome reward: sum_c weights[c] * final_rewards[c] (weight 1 for unlisted components)."""
        total = np.zeros(self.num_rows, np.float32)
        for name, value in self.final_rewards.items():
            total += np.float32(weights.get(name, 1.0)) * value
        return total

    def step_total_reward(self, weights: dict[str, float]) -> np.ndarray:
        """[S] scalar reward of each step span: sum_c weights[c] * step_rewards[c] (weight 1 for unlisted ones)."""
        total = np.zeros(0 if self.step_spans is None else len(self.step_spans), np.float32)
        for name, value in self.step_rewards.items():
            total += np.float32(weights.get(name, 1.0)) * value
        return total

    # -- rows ---------------------------------------------------------------------------------------------

    def select(self, rows: np.ndarray) -> Trajectories:
        """The rows where the boolean mask ``rows`` [N] is True (or the listed row indices), in order."""
        index = np.flatnonzero(rows) if rows.dtype == bool else np.asarray(rows, np.int64)
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ROW_COLUMNS or f.name in POSITION_COLUMNS:
                out[f.name] = None if value is None else value[index]
            elif f.name in ("rewards", "final_rewards"):
                out[f.name] = {k: v[index] for k, v in value.items()}
        remap = np.full(self.num_rows, -1, np.int64)
        remap[index] = np.arange(len(index))
        spans = _select_spans(self.step_spans, remap)
        out["step_spans"] = None if self.step_spans is None else _renumber(self.step_spans[spans], remap)
        out["step_rewards"] = {k: v[spans] for k, v in self.step_rewards.items()}
        out["state_keys"] = None if self.state_keys is None else self.state_keys[spans]
        out["truncation_index"], out["truncation_obs"] = self.truncation_index, self.truncation_obs
        out["truncation_critic_obs"] = self.truncation_critic_obs
        if self.truncation_index is not None:
            kept = remap[self.truncation_index[:, 0]] >= 0
            out["truncation_index"] = _renumber(self.truncation_index[kept], remap)
            for name in ("truncation_obs", "truncation_critic_obs"):
                value = getattr(self, name)
                out[name] = None if value is None else value[kept]
        out["extras"] = dict(self.extras)
        return Trajectories(**out)


def _select_spans(spans: np.ndarray | None, remap: np.ndarray) -> np.ndarray:
    if spans is None:
        return np.zeros(0, bool)
    return remap[spans[:, 0]] >= 0


def _renumber(index: np.ndarray, remap: np.ndarray) -> np.ndarray:
    """Rows in column 0 of ``index`` renumbered through ``remap`` (old row -> new row)."""
    out = index.copy()
    out[:, 0] = remap[index[:, 0]]
    return out


def _pad_stack(rows: Sequence[np.ndarray], width: int, dtype: Any, fill: Any = 0) -> np.ndarray:
    out = np.full((len(rows), width, *rows[0].shape[1:]) if rows else (0, width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def concat(parts: Sequence[Trajectories]) -> Trajectories:
    """One record of every row of ``parts``, in order (per-position columns re-padded to the widest)."""
    if not parts:
        raise ValueError("concat: no Trajectories to concatenate")
    if len(parts) == 1:
        return parts[0]
    width = max(p.width for p in parts)
    offsets = np.cumsum([0] + [p.num_rows for p in parts])
    out: dict[str, Any] = {}
    for f in dataclasses.fields(Trajectories):
        values = [getattr(p, f.name) for p in parts]
        if f.name in ROW_COLUMNS:
            out[f.name] = None if any(v is None for v in values) else np.concatenate(values)
        elif f.name in POSITION_COLUMNS:
            out[f.name] = None if any(v is None for v in values) else _concat_padded(values, width)
        elif f.name == "rewards":
            filled = _filled(parts, f.name, lambda p: (p.num_rows, p.width))
            out[f.name] = {k: _concat_padded([v[k] for v in filled], width) for k in filled[0]}
        elif f.name == "final_rewards":
            filled = _filled(parts, f.name, lambda p: (p.num_rows,))
            out[f.name] = {k: np.concatenate([v[k] for v in filled]) for k in filled[0]}
        elif f.name == "step_rewards":
            filled = _filled(parts, f.name, lambda p: (0 if p.step_spans is None else len(p.step_spans),))
            out[f.name] = {k: np.concatenate([v[k] for v in filled]) for k in filled[0]}
        elif f.name in ("step_spans", "truncation_index"):
            out[f.name] = None if any(v is None for v in values) else _concat_row_index(values, offsets)
        elif f.name == "state_keys":
            # a part without keys (its env has no state_key) gets a key unique to each of its steps
            keyed = [p.state_keys if p.state_keys is not None else unique_state_keys(p) for p in parts]
            out[f.name] = None if all(v is None for v in values) else np.concatenate(keyed)
        elif f.name in ("truncation_obs", "truncation_critic_obs"):
            out[f.name] = None if any(v is None for v in values) else np.concatenate(values)
        elif f.name == "extras":
            out[f.name] = {k: v for p in parts for k, v in p.extras.items()}
    return Trajectories(**out)


def _filled(parts: Sequence[Trajectories], name: str, shape: Callable[[Trajectories], tuple[int, ...]]) -> list:
    """Each part's ``name`` reward dict over every component any part has: a component a part lacks (no row of it
    earned one, say) is zeros of ``shape(part)`` there, since an absent reward is a zero one."""
    keys = sorted({k for p in parts for k in getattr(p, name)})
    return [{k: getattr(p, name).get(k, np.zeros(shape(p), np.float32)) for k in keys} for p in parts]


def _concat_padded(values: Sequence[np.ndarray], width: int) -> np.ndarray:
    padded = []
    for v in values:
        if v.shape[1] < width:
            pad = np.zeros((v.shape[0], width - v.shape[1], *v.shape[2:]), v.dtype)
            v = np.concatenate([v, pad], axis=1)
        padded.append(v)
    return np.concatenate(padded)


def _concat_row_index(values: Sequence[np.ndarray], offsets: np.ndarray) -> np.ndarray:
    shifted = []
    for v, offset in zip(values, offsets, strict=False):
        s = v.copy()
        s[:, 0] += offset
        shifted.append(s)
    return np.concatenate(shifted)


# -- env-state keys of steps (step-level credit) -----------------------------------------------------------------


@dataclass(frozen=True)
class UniqueStep:
    """The state key of a step whose env gave none (or whose ``state_key`` call failed): equal only to itself
    (the ``step``-th step of episode ``episode_id``; episode ids are unique within a run), and never to an env's
    key, so the step never shares a step group with another."""

    episode_id: int
    step: int


def unique_state_keys(traj: Trajectories) -> np.ndarray:
    """object [S]: ``UniqueStep(episode_id[row], k)`` for the k-th step span of each row, in span order."""
    spans = np.zeros((0, 3), np.int64) if traj.step_spans is None else traj.step_spans
    out = np.empty(len(spans), dtype=object)
    seen: dict[int, int] = {}
    for s, row in enumerate(spans[:, 0].tolist()):
        k = seen.get(row, 0)
        seen[row] = k + 1
        out[s] = UniqueStep(int(traj.episode_id[row]), k)
    return out


def _object_array(values: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)  # np.asarray would split tuple keys into columns
    out[:] = list(values)
    return out


# -- constructors for the two producers of today ----------------------------------------------------------------


def from_token_sequences(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    versions: Sequence[Sequence[int]],
    *,
    episode_ids: Sequence[int],
    group_ids: Sequence[int],
    final_rewards: dict[str, Sequence[float]],
    truncated: Sequence[bool],
    agent_id: str = "agent_0",
    policy_id: str = "default",
    step_ends: Sequence[Sequence[int]] | None = None,
    step_rewards: Sequence[Sequence[dict[str, float]] | None] | None = None,
) -> Trajectories:
    """Single-turn LLM episodes: row i = prompt i then response i, with one step span per step of the response
    (``from_turns`` with one turn per step).

    The loss mask is 1 on the response tokens; ``versions[i][t]`` is the policy version that sampled response
    token t; ``truncated[i]``: the response was cut at the length limit (else it ended, ``terminated``).

    Steps (process rewards, ``rlfabric.rewards.process``): ``step_ends[i]`` is where each step of response i ends,
    in response tokens (ascending, the last = its length; None: one step over the whole response), and
    ``step_rewards[i]`` the process components of each of its steps (None: none). ``step_rewards[c]`` of a span is
    its process component c, plus the row's outcome component c (``final_rewards``) on its last span, the answer
    span; ``final_rewards`` stays the outcome components as given.
    """
    rewards = {k: np.asarray(v, np.float32) for k, v in final_rewards.items()}
    turns = []
    for i, (r, lp, v) in enumerate(zip(responses, logprobs, versions, strict=True)):
        ends = [len(r)] if step_ends is None else list(step_ends[i])
        if not ends or ends[-1] != len(r) or any(b < a for a, b in zip([0, *ends], ends, strict=False)):
            raise ValueError(
                f"from_token_sequences: step_ends[{i}] = {ends}: must ascend to the response length {len(r)}"
            )
        process = None if step_rewards is None else step_rewards[i]
        if process is not None and len(process) != len(ends):
            raise ValueError(f"from_token_sequences: step_rewards[{i}] has {len(process)} steps, step_ends {len(ends)}")
        row: list[TurnTokens] = []
        for k, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
            components = dict(process[k]) if process is not None else {}
            if k == len(ends) - 1:
                components.update({c: float(value[i]) for c, value in rewards.items()})
            row.append(TurnTokens(r[start:end], lp[start:end], v[start:end], rewards=components))
        turns.append(row)
    out = from_turns(
        prompts,
        turns,
        episode_ids=episode_ids,
        group_ids=group_ids,
        truncated=truncated,
        agent_id=agent_id,
        policy_id=policy_id,
    )
    out.final_rewards = rewards  # the outcome components as given, every one kept (from_turns sums the steps')
    return out


@dataclass
class TurnTokens:
    """One agent turn as tokens: what the policy sampled (with behaviour logprobs and the version that sampled
    them), then the tokens appended after it (the env's observation inside the chat template's delimiters; empty
    after the last turn), the reward components the env gave for the turn, and the env's state key before the
    turn (``state_key()``, for step-level credit; None when the env gave none)."""

    sampled: Sequence[int]
    logprobs: Sequence[float]
    version: int | Sequence[int]  # one for the turn, or one per sampled token
    observation: Sequence[int] = ()
    rewards: dict[str, float] = field(default_factory=dict)
    state_key: Hashable | None = None


def from_turns(
    prompts: Sequence[Sequence[int]],
    episodes: Sequence[Sequence[TurnTokens]],
    *,
    episode_ids: Sequence[int],
    group_ids: Sequence[int],
    truncated: Sequence[bool],
    agent_id: str = "agent_0",
    policy_id: str = "default",
) -> Trajectories:
    """Multi-turn LLM episodes: row i = prompt i, then each turn's sampled tokens and the observation after them.

    The loss mask is 1 exactly on sampled tokens; their ``policy_version`` is the turn's version (a partial
    rollout's turns can differ), -1 on prompt and observation tokens. One step span per turn covers its sampled
    tokens; ``step_rewards[c]`` is the turn's component c (0 where the turn gave none) and ``final_rewards[c]``
    its sum over the episode. ``state_keys`` holds each turn's ``state_key``, a ``UniqueStep`` for a turn without
    one; None when no turn has one. ``truncated[i]``: the episode was cut (turn or token limit), else it ended.
    """
    n = len(prompts)
    lengths = np.array(
        [
            len(p) + sum(len(t.sampled) + len(t.observation) for t in turns)
            for p, turns in zip(prompts, episodes, strict=True)
        ],
        np.int32,
    )
    width = int(lengths.max()) if n else 0
    tokens = np.zeros((n, width), np.int32)
    sampled_tokens = np.full((n, width), -1, np.int32)
    loss_mask = np.zeros((n, width), np.float32)
    behaviour = np.zeros((n, width), np.float32)
    policy_version = np.full((n, width), NO_VERSION, np.int32)
    ended = np.zeros((n, width), bool)
    cut = np.zeros((n, width), bool)
    spans: list[tuple[int, int, int]] = []
    components = sorted({k for turns in episodes for t in turns for k in t.rewards})
    step_rewards: dict[str, list[float]] = {k: [] for k in components}
    final = {k: np.zeros(n, np.float32) for k in components}
    keyed = any(t.state_key is not None for turns in episodes for t in turns)
    state_keys: list[Hashable] = []
    for i, turns in enumerate(episodes):
        at = len(prompts[i])
        tokens[i, :at] = prompts[i]
        for step, t in enumerate(turns):
            end = at + len(t.sampled)
            tokens[i, at:end] = t.sampled
            sampled_tokens[i, at:end] = t.sampled
            loss_mask[i, at:end] = 1.0
            behaviour[i, at:end] = t.logprobs
            policy_version[i, at:end] = t.version
            spans.append((i, at, end))
            if keyed:
                state_keys.append(UniqueStep(int(episode_ids[i]), step) if t.state_key is None else t.state_key)
            for k in components:
                step_rewards[k].append(t.rewards.get(k, 0.0))
                final[k][i] += t.rewards.get(k, 0.0)
            at = end + len(t.observation)
            tokens[i, end:at] = t.observation
        if at > 0:
            (cut if truncated[i] else ended)[i, at - 1] = True
    return Trajectories(
        episode_id=np.asarray(episode_ids, np.int64),
        group_id=np.asarray(group_ids, np.int64),
        agent_id=np.full(n, agent_id, dtype=object),
        policy_id=np.full(n, policy_id, dtype=object),
        length=lengths,
        loss_mask=loss_mask,
        policy_version=policy_version,
        logprobs=behaviour,
        terminated=ended,
        truncated=cut,
        tokens=tokens,
        sampled_tokens=sampled_tokens,
        prompt_length=np.array([len(p) for p in prompts], np.int32),
        final_rewards=final,
        step_spans=np.asarray(spans, np.int32).reshape(-1, 3),
        step_rewards={k: np.asarray(v, np.float32) for k, v in step_rewards.items()},
        state_keys=_object_array(state_keys) if keyed else None,
    )


def from_time_major(
    *,
    obs: np.ndarray,
    actions: np.ndarray,
    logprobs: np.ndarray,
    rewards: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    version: int,
    bootstrap_obs: np.ndarray,
    truncation_index: np.ndarray,
    truncation_obs: np.ndarray,
    first_episode_id: int = 0,
    extras: dict[str, Any] | None = None,
    reward_components: dict[str, np.ndarray] | None = None,
) -> Trajectories:
    """A classic-RL fragment of T steps of N envs, given time-major ([T, N, ...]) as a vector env yields it:
    row i = env i's T steps (one version for the whole fragment). ``truncation_index`` rows are (t, env).
    ``rewards`` is the env's reward (component ``env``); ``reward_components`` ([T, N] each) are further named
    components of the same steps (a PPO run's ``env.reward_components``)."""
    t, n = rewards.shape

    def swap(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.swapaxes(a, 0, 1))

    trunc = np.asarray(truncation_index, np.int64).reshape(-1, 2)[:, ::-1].copy()  # (t, env) -> (row, position)
    return Trajectories(
        episode_id=np.arange(first_episode_id, first_episode_id + n, dtype=np.int64),
        group_id=np.full(n, NO_GROUP, np.int64),
        agent_id=np.full(n, "agent_0", dtype=object),
        policy_id=np.full(n, "default", dtype=object),
        length=np.full(n, t, np.int32),
        loss_mask=np.ones((n, t), np.float32),
        policy_version=np.full((n, t), version, np.int32),
        logprobs=swap(logprobs),
        terminated=swap(terminated),
        truncated=swap(truncated),
        obs=swap(obs),
        actions=swap(actions),
        bootstrap_obs=bootstrap_obs,
        truncation_index=trunc,
        truncation_obs=truncation_obs,
        rewards={"env": swap(rewards), **{k: swap(v) for k, v in (reward_components or {}).items()}},
        extras=extras or {},
    )


def time_major(column: np.ndarray) -> np.ndarray:
    """A per-position column [N, L, ...] as [L, N, ...] (a view), the layout GAE runs over."""
    return np.swapaxes(column, 0, 1)


def sampled_version(traj: Trajectories) -> np.ndarray:
    """[N] int64: the one policy version that sampled every loss token of a row; ``NO_VERSION`` for a row with no
    loss token or with tokens of several versions (a partial rollout), whose behaviour logprobs no single set of
    weights reproduces."""
    sampled = traj.loss_mask > 0
    versions = np.where(sampled, traj.policy_version, np.iinfo(np.int32).max)
    oldest = versions.min(axis=1, initial=np.iinfo(np.int32).max)
    newest = np.where(sampled, traj.policy_version, np.iinfo(np.int32).min).max(axis=1, initial=np.iinfo(np.int32).min)
    return np.where(sampled.any(axis=1) & (oldest == newest), oldest, NO_VERSION).astype(np.int64)


def drifted_rows(traj: Trajectories) -> tuple[np.ndarray, str | None]:
    """The trace check on arrival: [N] bool, True for rows whose ``tokens`` are not exactly the sampled ids
    wherever the producer placed a turn, or whose loss mask covers a token no generator sampled (a producer may
    leave sampled tokens out of the loss, never put others in); and a readable description of the first such
    row (None when every row checks). Rows without ``sampled_tokens`` pass."""
    if traj.sampled_tokens is None or traj.tokens is None:
        return np.zeros(traj.num_rows, bool), None
    placed = traj.sampled_tokens >= 0
    wrong = placed & (traj.tokens != traj.sampled_tokens)
    unplaced_loss = (traj.loss_mask > 0) & ~placed
    bad = (wrong | unplaced_loss).any(axis=1)
    if not bad.any():
        return bad, None
    row = int(np.flatnonzero(bad)[0])
    at = int(np.flatnonzero(wrong[row] | unplaced_loss[row])[0])
    window = slice(max(0, at - 3), at + 5)
    return bad, (
        f"episode {int(traj.episode_id[row])} (row {row}), position {at}: the record has tokens "
        f"{traj.tokens[row, window].tolist()} where the generator sampled {traj.sampled_tokens[row, window].tolist()} "
        "(-1: not sampled), loss mask "
        f"{traj.loss_mask[row, window].astype(int).tolist()}"
    )
