"""A language-model policy's moves in a game, as the token trajectories its learner trains on
(``multi_agent.policies.<name>.train``).

Each move is one row: the tokens of its rendered observation (the prompt), the reply the generator sampled (the
response, under the loss mask), the reply's per-token behaviour logprobs and the version of the weights that sampled
it. A move's outcome is known only when its agent's episode ends, so ``LLMTurnBuffer`` holds each (env copy, agent)'s
moves until then and hands over whole episodes only. Each row carries two named reward components:

- ``return``: the agent's return from that move to its episode's end, G_t = r_t + G_{t+1} (undiscounted: a game's
  outcome is credited to every move that led to it);
- ``invalid``: 1 when the reply named no legal move (the runner played a random legal move instead), else 0.

The policy's learner weights them (``return`` 1, ``invalid`` minus ``invalid_move_penalty``) and takes the batch
as one group: A = (R - mean R) / (std R + eps), GRPO's group baseline over all the iteration's moves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from rlfabric.algorithms.step_credit import discounted_step_returns
from rlfabric.multiagent.games import AgentStream
from rlfabric.trajectory import Trajectories, from_token_sequences

MOVES_GROUP = 0  # every move of an iteration is in one group: the batch is the baseline


@dataclass(frozen=True)
class LLMTurn:
    """One move of a language-model player: what it read, what it replied, and whether the reply was a legal move."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    version: int
    invalid: bool


@dataclass
class _Move:
    turn: LLMTurn
    reward: float
    ends_episode: bool


class LLMTurnBuffer:
    """The closed moves of one llm policy per (env copy, agent), until their episode ends."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.pending: dict[tuple[int, str], list[_Move]] = {}

    def add(self, copy_index: int, agent: str, stream: AgentStream) -> None:
        """A stream's closed steps (``AgentStream.take``), whose ``extras`` are the moves' ``LLMTurn``s."""
        moves = self.pending.setdefault((copy_index, agent), [])
        for turn, reward, terminated, truncated in zip(
            stream.extras, stream.rewards, stream.terminated, stream.truncated, strict=True
        ):
            moves.append(_Move(turn, reward, terminated or truncated))

    def take_finished(self, first_episode_id: int) -> Trajectories:
        """One record of the moves whose episodes have ended (row i gets episode id ``first_episode_id + i``);
        the moves of an episode still being played stay for a later call."""
        rows: list[tuple[str, _Move, float]] = []
        still_playing: dict[tuple[int, str], list[_Move]] = {}
        for key, moves in self.pending.items():
            last_end = max((i for i, m in enumerate(moves) if m.ends_episode), default=-1)
            finished = moves[: last_end + 1]
            if last_end + 1 < len(moves):
                still_playing[key] = moves[last_end + 1 :]
            ends = np.array([m.ends_episode for m in finished], bool)
            episode_of_move = np.cumsum(ends) - ends  # moves up to an episode's last share its number
            returns = discounted_step_returns(episode_of_move, np.array([m.reward for m in finished]), 1.0)
            rows += [(key[1], m, float(g)) for m, g in zip(finished, returns, strict=True)]
        self.pending = still_playing
        turns = [m.turn for _, m, _ in rows]
        record = from_token_sequences(
            [t.prompt_ids for t in turns],
            [t.token_ids for t in turns],
            [t.logprobs for t in turns],
            [[t.version] * len(t.token_ids) for t in turns],
            episode_ids=range(first_episode_id, first_episode_id + len(rows)),
            group_ids=[MOVES_GROUP] * len(rows),
            final_rewards={"return": [g for _, _, g in rows], "invalid": [float(t.invalid) for t in turns]},
            truncated=[False] * len(rows),
            policy_id=self.policy,
        )
        return replace(record, agent_id=np.array([agent for agent, _, _ in rows], dtype=object))
