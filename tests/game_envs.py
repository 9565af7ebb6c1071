"""Games for the tests: tic-tac-toe that raises on a move its action mask forbids; a game whose agents come and go."""

from __future__ import annotations

import gymnasium
import numpy as np
import pettingzoo
from pettingzoo import ParallelEnv


class IllegalMoveGuard(pettingzoo.utils.BaseWrapper):
    """Raises on a move the action mask forbids (tic-tac-toe itself would end the game with a -1 for the mover,
    so an illegal move would pass unseen)."""

    def step(self, action):
        if action is not None and not self.observe(self.agent_selection)["action_mask"][action]:
            raise RuntimeError(f"illegal move {action} by {self.agent_selection}")
        super().step(action)


def guarded_tictactoe():
    return IllegalMoveGuard(pettingzoo.make("aec", "classic/tictactoe-v3"))


class Relay(ParallelEnv):
    """A Parallel game whose agents come and go: ``early`` finishes after 2 steps, ``late`` joins at step 3, and
    ``stay`` plays all 6; each agent is rewarded 1 per step it acts, 10 on its last one."""

    metadata = {"name": "relay_v0", "is_parallelizable": True}
    possible_agents = ["early", "stay", "late"]
    spans = {"early": (0, 2), "stay": (0, 6), "late": (3, 6)}  # steps [start, end) each agent acts

    observation = gymnasium.spaces.Box(0.0, 10.0, (1,), np.float32)
    action = gymnasium.spaces.Discrete(2)

    def observation_space(self, agent):
        return self.observation

    def action_space(self, agent):
        return self.action

    def _obs(self, agent):
        return np.array([self.t], np.float32)

    def reset(self, seed=None, options=None):
        self.t = 0
        self.agents = [a for a in self.possible_agents if self.spans[a][0] == 0]
        return {a: self._obs(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        assert set(actions) == set(self.agents), (sorted(actions), self.agents)
        self.t += 1
        done = {a: self.spans[a][1] == self.t for a in self.agents}
        rewards = {a: 10.0 if done[a] else 1.0 for a in self.agents}
        joining = [a for a in self.possible_agents if self.spans[a][0] == self.t]
        for agent in joining:  # a late agent's first observation comes with the step it joins on
            done[agent], rewards[agent] = False, 0.0
        self.agents = [a for a in self.agents if not done[a]] + joining
        obs = {a: self._obs(a) for a in done}
        return obs, rewards, done, dict.fromkeys(done, False), {a: {} for a in done}


def relay():
    return Relay()


class BrokenRelay(Relay):
    """``Relay`` with one bad value: ``field`` "reward" (agent ``stay`` gets NaN at step 3) or "obs" (every
    agent's first observation is infinite)."""

    def __init__(self, field: str = "reward") -> None:
        self.field = field

    def reset(self, seed=None, options=None):
        obs, infos = super().reset(seed, options)
        if self.field == "obs":
            obs = {a: np.full(1, np.inf, np.float32) for a in obs}
        return obs, infos

    def step(self, actions):
        obs, rewards, done, truncated, infos = super().step(actions)
        if self.field == "reward" and self.t == 3:
            rewards["stay"] = float("nan")
        return obs, rewards, done, truncated, infos


def broken_relay(field: str = "reward"):
    return BrokenRelay(field)


def by_seat(agent: str) -> str:
    """A policy mapping function: player_1 -> first, every other agent -> second."""
    return "first" if agent == "player_1" else "second"


def by_seat_old_net(agent: str) -> str:
    """player_1 plays the frozen policy "old", player_2 the learning "net"."""
    return "old" if agent == "player_1" else "net"


def first_legal(observations, masks):
    """A scripted rule: the lowest legal cell."""
    return [int(np.flatnonzero(mask)[0]) for mask in masks]


def out_of_range(observations, masks):
    """A scripted rule that names a move past the board (a cell index counted from 1)."""
    return [len(mask) for mask in masks]


class PickOne(ParallelEnv):
    """A one-move Parallel game: each of two agents picks 0, 1 or 2 and is rewarded 1 for picking 1, else 0."""

    metadata = {"name": "pick_one_v0", "is_parallelizable": True}
    possible_agents = ["left", "right"]
    observation = gymnasium.spaces.Box(0.0, 1.0, (1,), np.float32)
    action = gymnasium.spaces.Discrete(3)

    def observation_space(self, agent):
        return self.observation

    def action_space(self, agent):
        return self.action

    def reset(self, seed=None, options=None):
        self.agents = list(self.possible_agents)
        return {a: np.zeros(1, np.float32) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        rewards = {a: float(actions[a] == 1) for a in self.agents}
        obs = {a: np.zeros(1, np.float32) for a in self.agents}
        done = dict.fromkeys(self.agents, True)
        self.agents = []
        return obs, rewards, done, dict.fromkeys(done, False), {a: {} for a in done}


def pick_one():
    return PickOne()


def pick_prompt(observation, mask):
    """PickOne as text for a language model."""
    return "pick 0, 1 or 2:"
