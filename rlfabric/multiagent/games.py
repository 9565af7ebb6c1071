"""One copy of a PettingZoo game, stepped for a rollout worker: who must act now, what each agent's steps were.

Parallel and AEC envs look the same from outside. ``requests()`` lists the agents that must act now (every live
agent of a Parallel env; the selected agent of an AEC env), ``apply(actions)`` steps the env with their actions.
Each agent's own steps accumulate in an ``AgentStream``: a step opens when the agent acts and closes when its reward
is known — at once in a Parallel env, at the agent's next turn (or the game's end) in an AEC env, where
``last()`` gives the reward gathered since the agent last acted. So a turn-based game's rewards that arrive on the
opponent's move (a loss) land on the step that earned them. ``take_rows()`` hands over each stream's closed steps at
the end of a fragment; a step still open carries over into the next fragment.

Agents that finish early simply stop being asked; agents that join late start a stream when first asked. A game
whose agents are all done is reset with the next seed.

Every observation and reward an agent gets is checked to be finite: a NaN or an infinity is the env's error
(``rlfabric.vector.NonFiniteEnvOutput``, naming the game, the agent and the step), as in single-agent envs, since
one poisons its policy's normalizer statistics, advantages and weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pettingzoo.utils.env import ParallelEnv

from rlfabric.multiagent.spaces import AgentSpaces
from rlfabric.vector import non_finite_error


def is_parallel(env: Any) -> bool:
    return isinstance(env, ParallelEnv)


class CriticInput:
    """What a centralized critic sees: the env's global ``state()`` when it has one, else every possible agent's
    flat observation concatenated (zeros for an agent that has none now); then a one-hot of the agent among
    ``possible_agents``, so one shared critic can tell the agents apart (MAPPO's agent-specific global state)."""

    def __init__(self, env: Any, spaces: dict[str, AgentSpaces]) -> None:
        self.agents = list(env.possible_agents)
        self.spaces = spaces
        self.uses_state = has_state(env)
        state_dim = (
            int(np.asarray(env.state()).size) if self.uses_state else sum(spaces[a].obs_dim for a in self.agents)
        )
        self.dim = state_dim + len(self.agents)

    def __call__(self, env: Any, agent: str, latest_obs: dict[str, np.ndarray]) -> np.ndarray:
        return self.for_agent(self.shared(env, latest_obs), agent)

    def shared(self, env: Any, latest_obs: dict[str, np.ndarray]) -> np.ndarray:
        """The part every agent sees alike: the global state, or the agents' latest observations."""
        if self.uses_state:
            return np.asarray(env.state(), np.float32).reshape(-1)
        return np.concatenate([latest_obs.get(a, np.zeros(self.spaces[a].obs_dim, np.float32)) for a in self.agents])

    def for_agent(self, shared: np.ndarray, agent: str) -> np.ndarray:
        one_hot = np.zeros(len(self.agents), np.float32)
        one_hot[self.agents.index(agent)] = 1.0
        return np.concatenate([shared, one_hot])


def has_state(env: Any) -> bool:
    """Whether the env has a working global ``state()`` (PettingZoo's optional method); the env must be reset."""
    try:
        np.asarray(env.state())
    except (NotImplementedError, AttributeError):
        return False
    return True


@dataclass
class AgentStream:
    """One agent's own steps in one env copy under one actor (policy or snapshot), since the last ``take``."""

    record: bool  # False: an opponent's steps, counted but not kept (nothing trains on them)
    obs: list[np.ndarray] = field(default_factory=list)
    critic: list[np.ndarray] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)
    actions: list[Any] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    terminated: list[bool] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    truncations: list[tuple[int, np.ndarray, np.ndarray | None]] = field(default_factory=list)
    extras: list[Any] = field(default_factory=list)  # what the policy kept with each step (an LLM's turn) or None
    next_obs: np.ndarray | None = None  # what the agent observed after its last closed step (the bootstrap)
    next_critic: np.ndarray | None = None
    pending: dict[str, Any] | None = None  # the open step, awaiting its reward

    @property
    def closed(self) -> int:
        return len(self.rewards)

    def open(
        self,
        obs: np.ndarray,
        critic: np.ndarray | None,
        mask: np.ndarray | None,
        action: Any,
        logp: float,
        version: int,
        extra: Any = None,
    ) -> None:
        self.pending = {
            "obs": obs,
            "critic": critic,
            "mask": mask,
            "action": action,
            "logp": logp,
            "version": version,
            "extra": extra,
        }

    def close(
        self, reward: float, terminated: bool, truncated: bool, next_obs: np.ndarray, next_critic: np.ndarray | None
    ) -> None:
        step, self.pending = self.pending, None
        if step is None or not self.record:
            return
        self.obs.append(step["obs"])
        self.critic.append(step["critic"])
        self.masks.append(step["mask"])
        self.actions.append(step["action"])
        self.logprobs.append(step["logp"])
        self.versions.append(step["version"])
        self.extras.append(step["extra"])
        self.rewards.append(float(reward))
        self.terminated.append(bool(terminated))
        self.truncated.append(bool(truncated) and not terminated)
        if truncated and not terminated:
            self.truncations.append((self.closed - 1, next_obs, next_critic))
        self.next_obs, self.next_critic = next_obs, next_critic

    def take(self) -> AgentStream:
        """The closed steps so far, as a stream of their own; this one keeps only its open step."""
        taken = AgentStream(
            self.record,
            self.obs,
            self.critic,
            self.masks,
            self.actions,
            self.logprobs,
            self.versions,
            self.rewards,
            self.terminated,
            self.truncated,
            self.truncations,
            self.extras,
            self.next_obs,
            self.next_critic,
        )
        pending = self.pending
        self.__init__(self.record)  # type: ignore[misc]
        self.pending, self.next_obs, self.next_critic = pending, taken.next_obs, taken.next_critic
        return taken


@dataclass
class Request:
    """An agent that must act now, with what its policy sees."""

    copy: int
    agent: str
    actor: str  # the policy (or opponent snapshot) that plays this agent in this episode
    obs: np.ndarray
    mask: np.ndarray | None
    critic: np.ndarray | None
    extra: Any = None  # what the acting policy keeps with the step (``AgentStream.extras``), set when it acts


@dataclass
class EpisodeEnd:
    """A finished episode of one env copy: each agent's return, who played it, and the env steps it took."""

    returns: dict[str, float]
    actors: dict[str, str]
    length: int


class GameCopy:
    """One env copy (see the module docstring). ``assign(copy_index) -> {agent: actor}`` is asked at each reset
    for who plays which agent this episode; ``records(actor)`` says whether that actor's steps are kept."""

    def __init__(
        self,
        index: int,
        env: Any,
        spaces: dict[str, AgentSpaces],
        critic: CriticInput | None,
        assign: Callable[[int], dict[str, str]],
        records: Callable[[str], bool],
        name: str = "game",
    ) -> None:
        """``name``: what errors call the env (its ``env.id``)."""
        self.index, self.env, self.spaces, self.critic_input = index, env, spaces, critic
        self.name = name
        self.assign, self.records = assign, records
        self.parallel = is_parallel(env)
        self.streams: dict[tuple[str, str], AgentStream] = {}
        self.actors: dict[str, str] = {}
        self.returns: dict[str, float] = {}
        self.length = 0
        self.latest: dict[str, np.ndarray] = {}  # each agent's latest flat observation (for the critic's fallback)
        self.parallel_obs: dict[str, Any] = {}
        self.selected: tuple[str, Any] = ("", None)  # AEC: the agent to act and its observation, from last()
        self.state_now: np.ndarray | None = None  # the env's global state() since its last step or reset
        self.seed = 0

    # -- episodes -------------------------------------------------------------------------------------------

    def reset(self, seed: int) -> list[EpisodeEnd]:
        self.seed = seed
        self.actors = self.assign(self.index)
        self.returns = {}
        self.length = 0
        self.latest = {}
        if self.parallel:
            self.parallel_obs, _ = self.env.reset(seed=seed)
            self._stepped()
            for agent, raw in self.parallel_obs.items():
                self.latest[agent] = self._finite_obs(agent, self.spaces[agent].encode(raw)[0])
            return []
        self.env.reset(seed=seed)
        self._stepped()
        return self._advance_aec()

    def _stream(self, agent: str) -> AgentStream:
        actor = self.actors[agent]
        key = (agent, actor)
        if key not in self.streams:
            self.streams[key] = AgentStream(self.records(actor))
        return self.streams[key]

    def _critic(self, agent: str) -> np.ndarray | None:
        critic = self.critic_input
        if critic is None:
            return None
        if not critic.uses_state:  # the latest observations change agent by agent as their steps close
            return critic(self.env, agent, self.latest)
        if self.state_now is None:  # one state() per step, not one per agent and again per request
            self.state_now = critic.shared(self.env, self.latest)
        return critic.for_agent(self.state_now, agent)

    def _stepped(self) -> None:
        """The env moved (a step or a reset): its state is read again when next needed."""
        self.state_now = None

    def _finite_obs(self, agent: str, flat: np.ndarray) -> np.ndarray:
        if not np.isfinite(flat).all():
            raise self._non_finite(f"observation for agent {agent!r}", flat)
        return flat

    def _non_finite(self, what: str, value: object) -> Exception:
        where = f"at step {self.length} of an episode" if self.length else "at reset"
        return non_finite_error(self.name, what, value, f"{where} (env copy {self.index})")

    def _close(self, agent: str, raw_obs: Any, reward: float, terminated: bool, truncated: bool) -> None:
        flat = self._finite_obs(agent, self.spaces[agent].encode(raw_obs)[0])
        if not math.isfinite(reward):
            raise self._non_finite(f"reward for agent {agent!r}", reward)
        self.latest[agent] = flat
        self.returns[agent] = self.returns.get(agent, 0.0) + float(reward)
        stream = self._stream(agent)
        if stream.pending is not None:
            stream.close(reward, terminated, truncated, flat, self._critic(agent))

    def _episode_over(self) -> list[EpisodeEnd]:
        end = EpisodeEnd(dict(self.returns), dict(self.actors), self.length)
        return [end, *self.reset(self.seed + 1)]

    def _advance_aec(self) -> list[EpisodeEnd]:
        """Step past agents that are done (AEC: they must step with None) until a live agent is selected, closing
        each visited agent's open step with the reward ``last()`` gathered for it; reset when the game is over."""
        env = self.env
        while env.agents:
            agent = env.agent_selection
            raw, reward, terminated, truncated, _ = env.last()
            self._close(agent, raw, reward, terminated, truncated)
            if not (terminated or truncated):
                self.selected = (agent, raw)  # what requests() sends: observing again costs the wrappers' chain
                return []
            env.step(None)
            self._stepped()
        return self._episode_over()

    # -- acting ---------------------------------------------------------------------------------------------

    def requests(self) -> list[Request]:
        if self.parallel:
            agents = [(a, self.parallel_obs[a]) for a in self.env.agents]
        else:
            agents = [self.selected]
        out = []
        for agent, raw in agents:
            flat, mask = self.spaces[agent].encode(raw)
            self.latest[agent] = flat
            out.append(Request(self.index, agent, self.actors[agent], flat, mask, None))
        if self.critic_input is not None:
            for r in out:
                r.critic = self._critic(r.agent)
        return out

    def apply(self, acted: list[tuple[Request, Any, float, int]]) -> list[EpisodeEnd]:
        """Step the env with (request, action, logprob, version) for each request; return finished episodes."""
        for request, action, logp, version in acted:
            stream = self._stream(request.agent)
            stream.open(request.obs, request.critic, request.mask, action, logp, version, request.extra)
        self.length += 1
        if self.parallel:
            obs, rewards, terminations, truncations, _ = self.env.step({r.agent: a for r, a, _, _ in acted})
            self._stepped()
            self.parallel_obs = obs
            for request, *_ in acted:
                a = request.agent
                self._close(a, obs[a], rewards.get(a, 0.0), terminations.get(a, False), truncations.get(a, False))
            return self._episode_over() if not self.env.agents else []
        (request, action, _, _) = acted[0]
        self.env.step(action)
        self._stepped()
        return self._advance_aec()

    def take_rows(self) -> list[tuple[str, str, AgentStream]]:
        """(agent, actor, closed steps) for every recorded stream with steps since the last take."""
        out = []
        for (agent, actor), stream in self.streams.items():
            if stream.record and stream.closed:
                out.append((agent, actor, stream.take()))
        # Streams of actors no longer playing (self-play seats change per episode) are dropped once empty.
        self.streams = {k: s for k, s in self.streams.items() if s.pending is not None or self.actors.get(k[0]) == k[1]}
        return out
