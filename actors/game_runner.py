"""GameRunner: several copies of a multi-agent game (PettingZoo) plus a local copy of every policy that plays it.

Each tick, the agents that must act in every copy are batched by the policy that plays them (one numpy call per
policy), so many copies cost one forward pass per policy, not one per agent. A fragment is one trajectory record
per trainable policy (rlfabric.trajectory): one row per agent and copy, holding that agent's own steps, with its
``agent_id`` and ``policy_id``, action masks and, for a centralized critic, ``critic_obs``. The runner returns them
as separate objects, so each learner fetches only its own policy's data.

Self-play: the runner holds frozen snapshots of the learning policy (``set_opponents``) and draws one per episode
with the driver's probabilities; the games' outcomes against each snapshot come back in the metadata.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import ray

from rlfabric import registry, shipping
from rlfabric.actors.env_runner import RunnerProcess
from rlfabric.multiagent.baselines import scripted_rule, text_renderer
from rlfabric.multiagent.config import (
    MultiAgentConfig,
    PolicySpec,
    policy_specs,
    trainable_policies,
    trained_llm_policies,
)
from rlfabric.multiagent.games import CriticInput, EpisodeEnd, GameCopy, Request
from rlfabric.multiagent.llm_turns import LLMTurnBuffer
from rlfabric.multiagent.mapping import plan_game
from rlfabric.multiagent.selfplay import game_score
from rlfabric.multiagent.spaces import AgentSpaces
from rlfabric.normalization import RunningStats, discounted_returns
from rlfabric.policies.game_llm import LLMPlayer, LLMServing
from rlfabric.policies.neural import NeuralNetPolicy
from rlfabric.policies.served import ServedLLMPolicy
from rlfabric.trajectory import NO_GROUP, Trajectories, time_major

SNAPSHOT = "snapshot:"  # actor name prefix of an opponent-pool snapshot
LLM_MOVE_TIMEOUT_S = 60.0  # default deadline of one batch of an llm policy's moves: past it, its generator is hung


def llm_player(
    spec: PolicySpec,
    serving: LLMServing,
    spaces: AgentSpaces,
    seed: int,
    render: Any,
    timeout_s: float = LLM_MOVE_TIMEOUT_S,
) -> LLMPlayer:
    """An llm policy's player in this runner, calling its generator actor; ``render`` its observation renderer.
    A generator that fails or misses ``timeout_s`` fails the sample with ``GeneratorsFailed`` naming it, and the
    driver replaces it."""
    params = {"temperature": spec.temperature, "max_new_tokens": spec.max_new_tokens}
    served = ServedLLMPolicy([serving.generator], params, timeout_s=timeout_s)
    return LLMPlayer(served, serving.model_dir, render, spaces.action.n, seed)


class FixedPolicy:
    """A policy that does not learn: uniform over the legal actions, or a scripted rule; log-probability 0."""

    def __init__(self, spaces: AgentSpaces, seed: int, rule: Any = None) -> None:
        """``rule``: a scripted policy's rule, resolved (``scripted_rule``); None: uniformly random."""
        self.rng = np.random.default_rng(seed)
        self.spaces = spaces
        self.rule = rule
        self.version = 0

    def act(self, obs: np.ndarray, masks: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        n = len(obs)
        if self.rule is not None:
            actions = np.asarray(self.rule(obs, masks if masks is not None else [None] * n))
        elif self.spaces.action.kind == "discrete":
            legal = masks if masks is not None else np.ones((n, self.spaces.action.n), bool)
            actions = np.array([self.rng.choice(np.flatnonzero(row)) for row in legal], np.int64)
        else:
            low, high = np.asarray(self.spaces.action.low), np.asarray(self.spaces.action.high)
            actions = self.rng.uniform(low, high, (n, self.spaces.action.n)).astype(np.float32)
        return actions, np.zeros(n, np.float32)


class GameRunnerCore:
    """The runner's logic without Ray, so it can be used and tested in-process."""

    def __init__(
        self,
        env_id: str,
        env_kwargs: dict[str, Any],
        num_envs: int,
        fragment_length: int,
        seed: int,
        multi_agent: MultiAgentConfig,
        obs_clip: float,
        registry_blob: bytes | None = None,
        llm_servers: dict[str, LLMServing] | None = None,
        agent_policies: dict[str, str] | None = None,
        callables_blob: bytes | None = None,
        episode_id_start: int = 0,
        llm_move_timeout_s: float = LLM_MOVE_TIMEOUT_S,
        gamma: float = 0.99,
    ) -> None:
        """``llm_servers``: for each llm policy, its model folder and the generator actor serving it.
        ``agent_policies``: agent -> policy as the driver resolved it (else the config's mapping is resolved here).
        ``callables_blob``: the config's scripted rules and renderers, shipped by the driver (``user_callables``).
        ``episode_id_start``: the first row's episode id (the driver gives each runner its own range).
        ``llm_move_timeout_s``: the deadline of a batch of an llm policy's moves (the driver's is half the sample's,
        so a hung generator is named, and replaced, before the sample's deadline). ``gamma``: the discount of the
        returns whose statistics a learner scales rewards by (``ppo.normalize_reward``)."""
        if registry_blob is not None:
            registry.load_snapshot(registry_blob)
        self.callables = shipping.loads(callables_blob) if callables_blob else {}
        self.env_id, self.env_kwargs, self.cfg = env_id, env_kwargs, multi_agent
        self.fragment_length = fragment_length
        self.rng = np.random.default_rng(seed)
        self.specs = policy_specs(multi_agent)
        self.trainable = trainable_policies(multi_agent)
        first = registry.make_multi_agent_env(env_id, env_kwargs)
        plan = plan_game(first, multi_agent, agent_policies)  # the driver's mapping: a mapping function ran there
        self.agents, self.spaces, self.mapping = plan.agents, plan.spaces, plan.mapping
        self.policy_spaces = plan.policy_spaces
        self.obs_clip = obs_clip
        self.policies: dict[str, Any] = {}
        for i, (name, spec) in enumerate(self.specs.items()):
            if name not in self.policy_spaces:
                continue  # a policy no agent is mapped to
            if spec.kind in ("neural", "frozen"):  # a frozen one gets its weights once, from set_frozen
                self.policies[name] = NeuralNetPolicy(obs_clip, seed + 101 * i)
            elif spec.kind == "llm":
                render = self._callable(spec.render or "", text_renderer)
                self.policies[name] = llm_player(
                    spec, (llm_servers or {})[name], self.policy_spaces[name], seed + i, render, llm_move_timeout_s
                )
            else:
                rule = self._callable(spec.rule, scripted_rule) if spec.kind == "scripted" and spec.rule else None
                self.policies[name] = FixedPolicy(self.policy_spaces[name], seed + 101 * i, rule)
        # a trained llm policy's moves wait here for the end of their episode (their return)
        self.llm_turns = {p: LLMTurnBuffer(p) for p in trained_llm_policies(multi_agent) if p in self.policies}
        self.snapshots: dict[int, NeuralNetPolicy] = {}
        self.snapshot_ids: list[int] = []
        self.snapshot_probs = np.zeros(0)
        envs = [first] + [registry.make_multi_agent_env(env_id, env_kwargs) for _ in range(num_envs - 1)]
        centralized = multi_agent.critic == "centralized"
        self.copies = []
        for i, env in enumerate(envs):
            env_seed = seed * 1000 + i
            if i == 0 or centralized:
                env.reset(seed=env_seed)  # the critic input's size needs a reset env
            critic = CriticInput(env, self.spaces) if centralized else None
            self.copies.append(GameCopy(i, env, self.spaces, critic, self._assign, self._records, env_id))
        self.critic_dim = self.copies[0].critic_input.dim if centralized else None
        for i, copy in enumerate(self.copies):
            copy.reset(seed * 1000 + i)
        self.next_episode_id = episode_id_start  # of the next row produced
        # What each trainable neural policy's learner merges into its normalizers: statistics of the raw
        # observations its net was given, and of its agents' running discounted returns, carried per (env copy,
        # agent) across fragments like EnvRunner's.
        self.gamma = gamma
        self.raw_obs: dict[str, list[np.ndarray]] = {p: [] for p in self.trainable}  # since the last fragment
        self.return_carry: dict[tuple[int, str], float] = {}

    def _callable(self, name: str, resolve: Any) -> Any:
        """A rule or renderer the driver shipped, or else resolved here by name."""
        return self.callables[name] if name in self.callables else resolve(name)

    # -- who plays whom ---------------------------------------------------------------------------------------

    def _assign(self, copy_index: int) -> dict[str, str]:
        """This episode's actor per agent: its mapped policy; under self-play, one agent of the learning policy
        plays it and the policy's other agents play a snapshot drawn from the pool, except in a share
        ``latest_prob`` of episodes (and while the pool is empty), where the learning policy plays every seat."""
        actors = dict(self.mapping)
        sp = self.cfg.self_play
        if not sp.enabled or not self.snapshot_ids or self.rng.random() < sp.latest_prob:
            return actors
        seats = [a for a, p in self.mapping.items() if p == sp.policy]
        learner_seat = seats[int(self.rng.integers(len(seats)))]
        opponent = SNAPSHOT + str(
            self.snapshot_ids[int(self.rng.choice(len(self.snapshot_ids), p=self.snapshot_probs))]
        )
        for agent in seats:
            if agent != learner_seat:
                actors[agent] = opponent
        return actors

    def _records(self, actor: str) -> bool:
        return actor in self.trainable

    # -- weights ------------------------------------------------------------------------------------------------

    def spaces_info(self) -> dict[str, dict[str, Any]]:
        """What each trainable policy's learner needs: observation size, action head, critic input size."""
        return {
            p: {
                "obs_dim": self.policy_spaces[p].obs_dim,
                "action": self.policy_spaces[p].action,
                "critic_dim": self.critic_dim,
            }
            for p in self.trainable
        }

    @property
    def version(self) -> int:
        return min(self.policies[p].version for p in self.trainable)

    def set_weights(self, *weights: dict[str, Any]) -> int:
        """Install one published version per trainable policy, in ``trainable`` order."""
        for name, w in zip(self.trainable, weights, strict=True):
            self.policies[name].set_weights(w)
        return self.version

    def set_llm_servers(self, servers: dict[str, LLMServing]) -> None:
        """The generators now serving the llm policies (the driver replaced one that died or hung)."""
        for name, serving in servers.items():
            if name in self.policies:
                self.policies[name].serve_from(serving)

    def set_frozen(self, weights: dict[str, dict[str, Any]]) -> None:
        """Install the saved weights of each frozen policy (``rlfabric.game_driver.frozen_weights``)."""
        for name, w in weights.items():
            if name in self.policies:
                self.policies[name].set_weights(w)

    def set_opponents(self, probabilities: dict[int, float], weights: dict[int, Any]) -> None:
        """The opponent pool: snapshot id -> weights (a published version, or a ref to one) and the probability of
        drawing it for an episode."""
        for sid, w in weights.items():
            if sid not in self.snapshots:
                policy = NeuralNetPolicy(self.obs_clip, int(self.rng.integers(2**31)))
                policy.set_weights(ray.get(w) if isinstance(w, ray.ObjectRef) else w)
                self.snapshots[sid] = policy
        playing = {actor for c in self.copies for actor in c.actors.values()}
        # a snapshot that left the pool stays until the episodes playing it end
        self.snapshots = {
            sid: p for sid, p in self.snapshots.items() if sid in probabilities or SNAPSHOT + str(sid) in playing
        }
        self.snapshot_ids = sorted(probabilities)
        probs = np.array([probabilities[s] for s in self.snapshot_ids], np.float64)
        self.snapshot_probs = probs / probs.sum() if len(probs) else probs

    def _policy(self, actor: str) -> Any:
        return self.snapshots[int(actor[len(SNAPSHOT) :])] if actor.startswith(SNAPSHOT) else self.policies[actor]

    # -- sampling -----------------------------------------------------------------------------------------------

    def _act(self, requests: list[Request], greedy: bool = False) -> dict[int, list[tuple[Request, Any, float, int]]]:
        """One call per actor over all its requests; the results grouped back by env copy."""
        by_actor: dict[str, list[Request]] = {}
        for r in requests:
            by_actor.setdefault(r.actor, []).append(r)
        out: dict[int, list[tuple[Request, Any, float, int]]] = {}
        for actor, reqs in by_actor.items():
            policy = self._policy(actor)
            obs = np.stack([r.obs for r in reqs])
            masks = None if reqs[0].mask is None else np.stack([r.mask for r in reqs])
            if isinstance(policy, NeuralNetPolicy):
                if actor in self.raw_obs and not greedy:  # training steps only, not evaluation games
                    self.raw_obs[actor].append(obs)
                acted = policy.act(obs, greedy=greedy, mask=masks)
                actions, logps = acted.actions, acted.logprobs
                obs_seen = acted.info["inputs"]
            else:
                actions, logps = policy.act(obs, masks)
                obs_seen = obs
            if actor.startswith(SNAPSHOT) and self.cfg.self_play.opponent_epsilon > 0:
                actions = self._explore(actions, masks)
            turns = policy.last_turns if isinstance(policy, LLMPlayer) else None
            for i, r in enumerate(reqs):
                r.obs = obs_seen[i]  # what the net saw (normalized when normalizing), which the learner trains on
                r.extra = None if turns is None else turns[i]
                out.setdefault(r.copy, []).append((r, actions[i], float(logps[i]), policy.version))
        return out

    def _explore(self, actions: np.ndarray, masks: np.ndarray | None) -> np.ndarray:
        """A snapshot's actions, each replaced by a uniformly random legal one with probability opponent_epsilon
        (its logprobs are not used: nothing trains on an opponent's steps). Snapshots are of the self-play policy,
        so its spaces say what a random action is; a continuous one is left as it is."""
        actions = np.array(actions)
        swap = self.rng.random(len(actions)) < self.cfg.self_play.opponent_epsilon
        action = self.policy_spaces[self.cfg.self_play.policy].action
        for i in np.flatnonzero(swap):
            if masks is not None:
                actions[i] = self.rng.choice(np.flatnonzero(masks[i]))
            elif action.kind == "discrete":
                actions[i] = self.rng.integers(action.n)
        return actions

    def _tick(self, copies: list[GameCopy], greedy: bool = False) -> list[EpisodeEnd]:
        requests = [r for c in copies for r in c.requests()]
        acted = self._act(requests, greedy)
        ends: list[EpisodeEnd] = []
        for c in copies:
            ends += c.apply(acted[c.index])
        return ends

    def sample(self) -> tuple[Any, ...]:
        """Step every copy ``fragment_length`` times; return (small metadata, then one trajectory record per
        trainable policy, in ``trainable`` order)."""
        if self.version < 0:
            raise RuntimeError("GameRunner.sample called before set_weights")
        start = time.perf_counter()
        ends: list[EpisodeEnd] = []
        for _ in range(self.fragment_length):
            ends += self._tick(self.copies)
        rows: dict[str, list[tuple[str, Any]]] = {p: [] for p in self.trainable}
        copies: dict[str, list[int]] = {p: [] for p in self.trainable}  # each row's env copy
        for c in self.copies:
            for agent, actor, stream in c.take_rows():
                if actor in self.llm_turns:
                    self.llm_turns[actor].add(c.index, agent, stream)
                else:
                    rows[actor].append((agent, stream))
                    copies[actor].append(c.index)
        fragments = [self._fragment(p, rows[p], copies[p]) for p in self.trainable]
        meta = {
            "version": self.version,
            "env_steps": self.fragment_length * len(self.copies),
            # an llm policy's steps are its moves (one row each); a neural policy's are its rows' lengths
            "agent_steps": {
                p: int(f.num_rows if p in self.llm_turns else f.length.sum())
                for p, f in zip(self.trainable, fragments, strict=True)
            },
            "episode_returns": [self._trained_return(e) for e in ends],
            "episode_lengths": [e.length for e in ends],
            "policy_returns": self._policy_returns(ends),
            "games": self._games(ends),
            "llm_moves": self._llm_moves(),
            "llm_generators": self._llm_generators(),
            "sample_time_s": time.perf_counter() - start,
        }
        return (meta, *fragments)

    def _llm_moves(self) -> dict[str, tuple[int, int]]:
        """(moves, invalid moves) of each llm policy since the last fragment."""
        out = {}
        for name, policy in self.policies.items():
            if isinstance(policy, LLMPlayer):
                out[name] = (policy.moves, policy.invalid)
                policy.moves = policy.invalid = 0
        return out

    def _llm_generators(self) -> list[tuple[int, int]]:
        """The generators, as (slot, generation), that answered an llm policy's moves since the last fragment."""
        out = set()
        for policy in self.policies.values():
            if isinstance(policy, LLMPlayer):
                out |= policy.answered
                policy.answered = set()
        return sorted(out)

    def _trained_return(self, end: EpisodeEnd) -> float:
        """An episode's return: the mean over the agents a trainable policy played (all agents if none did)."""
        mine = [r for a, r in end.returns.items() if end.actors.get(a) in self.trainable] or list(end.returns.values())
        return float(np.mean(mine)) if mine else 0.0

    def _policy_returns(self, ends: list[EpisodeEnd]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for e in ends:
            for agent, ret in e.returns.items():
                actor = e.actors.get(agent, "")
                if not actor.startswith(SNAPSHOT):
                    out.setdefault(actor, []).append(ret)
        return out

    def _games(self, ends: list[EpisodeEnd]) -> list[tuple[int, float]]:
        """Self-play results: (snapshot id, the learner's score: 1 win, 0.5 draw, 0 loss) per finished game
        played against a snapshot."""
        sp = self.cfg.self_play
        out = []
        for e in ends:
            learner = [r for a, r in e.returns.items() if e.actors.get(a) == sp.policy]
            opponents = [(a, r) for a, r in e.returns.items() if e.actors.get(a, "").startswith(SNAPSHOT)]
            if not sp.enabled or not learner or not opponents:
                continue
            sid = int(e.actors[opponents[0][0]][len(SNAPSHOT) :])
            out.append((sid, game_score(max(learner), max(r for _, r in opponents))))
        return out

    def _fragment(self, policy: str, rows: list[tuple[str, Any]], copies: list[int]) -> Trajectories:
        if policy in self.llm_turns:  # the moves of the episodes that ended, as token rows
            fragment = self.llm_turns[policy].take_finished(self.next_episode_id)
        else:
            spaces, first_id = self.policy_spaces[policy], self.next_episode_id
            fragment = game_fragment(policy, rows, spaces, self.critic_dim, first_id, self.policies[policy])
            keys = [(copy, agent) for copy, (agent, _) in zip(copies, rows, strict=True)]
            seen = self.raw_obs[policy]
            raw = np.concatenate(seen) if seen else np.zeros((0, spaces.obs_dim), np.float32)
            fragment.extras = {
                "obs_stats": RunningStats.of(raw).to_dict(),
                "return_stats": self._return_stats(fragment, keys).to_dict(),
            }
            self.raw_obs[policy] = []
        self.next_episode_id += fragment.num_rows
        return fragment

    def _return_stats(self, fragment: Trajectories, keys: list[tuple[int, str]]) -> RunningStats:
        """Statistics of the running discounted return at each of the fragment's steps, continuing each row's
        (env copy, agent) return from its last fragment; a step that ends the agent's episode resets it."""
        if not keys:
            return RunningStats.empty((1,))
        start = np.array([self.return_carry.get(key, 0.0) for key in keys])
        ends = fragment.terminated | fragment.truncated
        returns, _ = discounted_returns(time_major(fragment.rewards["env"]), time_major(ends), self.gamma, start)
        returns = returns.T  # [rows, width]; past a row's length it is padding
        for i, key in enumerate(keys):
            last = int(fragment.length[i]) - 1
            if ends[i, last]:  # the agent's episode is over: its next one starts from 0
                self.return_carry.pop(key, None)
            else:
                self.return_carry[key] = float(returns[i, last])
        return RunningStats.of(returns[fragment.within_length].reshape(-1, 1))

    # -- evaluation ---------------------------------------------------------------------------------------------

    def evaluate(self, episodes: int, seed: int) -> list[float]:
        """Returns of ``episodes`` episodes on a fresh env copy, every agent playing its mapped policy, the trainable
        ones greedily (the same call as ``EnvRunner.evaluate``)."""
        return [self._trained_return(e) for e in self._play(episodes, seed, lambda _: dict(self.mapping))]

    def evaluate_against(self, games: int, seed: int, opponent: str) -> dict[str, int]:
        """``games`` greedy games of the self-play policy against a baseline, ``opponent`` ("random" or
        "scripted:<rule>"): the policy plays one seat (alternating), the baseline the others. Wins, draws, losses."""
        kind, _, rule = opponent.partition(":")
        resolved = self._callable(rule, scripted_rule) if kind == "scripted" else None
        sp_policy = self.cfg.self_play.policy if self.cfg.self_play.policy in self.trainable else self.trainable[0]
        self.policies["baseline"] = FixedPolicy(self.policy_spaces[sp_policy], seed, resolved)
        seats = [a for a, p in self.mapping.items() if p == sp_policy]
        played = [0]

        def assign(_: int) -> dict[str, str]:
            actors = dict(self.mapping)
            learner_seat = seats[played[0] % len(seats)]
            played[0] += 1
            actors.update({agent: "baseline" for agent in seats if agent != learner_seat})
            return actors

        try:
            ends = self._play(games, seed, assign)
        finally:
            self.policies.pop("baseline")
        scores = []
        for e in ends:
            mine = max(r for a, r in e.returns.items() if e.actors[a] == sp_policy)
            theirs = max(r for a, r in e.returns.items() if e.actors[a] == "baseline")
            scores.append(game_score(mine, theirs))
        return {
            "wins": sum(s == 1.0 for s in scores),
            "draws": sum(s == 0.5 for s in scores),
            "losses": sum(s == 0.0 for s in scores),
            "games": len(scores),
        }

    def _play(self, episodes: int, seed: int, assign: Any) -> list[EpisodeEnd]:
        """``episodes`` episodes on a fresh env copy (training copies untouched), actors per episode from
        ``assign``, trainable policies greedy."""
        env = registry.make_multi_agent_env(self.env_id, self.env_kwargs)
        try:
            copy = GameCopy(0, env, self.spaces, None, assign, lambda _: False, self.env_id)
            ends = copy.reset(seed)
            while len(ends) < episodes:
                ends += self._tick([copy], greedy=True)
        finally:
            env.close()
        return ends[:episodes]


def game_fragment(
    policy: str,
    rows: list[tuple[str, Any]],
    spaces: AgentSpaces,
    critic_dim: int | None,
    first_episode_id: int,
    acting: NeuralNetPolicy,
) -> Trajectories:
    """One trajectory record of ``rows`` [(agent, AgentStream)]: row i = that agent's closed steps, right-padded."""
    n = len(rows)
    width = max((s.closed for _, s in rows), default=0)
    d, a = spaces.obs_dim, spaces.action
    lengths = np.array([s.closed for _, s in rows], np.int32)
    obs = np.zeros((n, width, d), np.float32)
    discrete = a.kind == "discrete"
    actions = np.zeros((n, width) if discrete else (n, width, a.n), np.int64 if discrete else np.float32)
    logp = np.zeros((n, width), np.float32)
    versions = np.full((n, width), -1, np.int32)
    rewards = np.zeros((n, width), np.float32)
    terminated = np.zeros((n, width), bool)
    truncated = np.zeros((n, width), bool)
    loss_mask = np.zeros((n, width), np.float32)
    masks = np.ones((n, width, a.n), bool) if spaces.mask_key is not None else None
    critic = np.zeros((n, width, critic_dim), np.float32) if critic_dim else None
    boot = np.zeros((n, d), np.float32)
    boot_critic = np.zeros((n, critic_dim), np.float32) if critic_dim else None
    trunc_index, trunc_obs, trunc_critic = [], [], []
    for i, (_, s) in enumerate(rows):
        k = s.closed
        obs[i, :k] = np.stack(s.obs)
        actions[i, :k] = np.asarray(s.actions)
        logp[i, :k] = s.logprobs
        versions[i, :k] = s.versions
        rewards[i, :k] = s.rewards
        terminated[i, :k] = s.terminated
        truncated[i, :k] = s.truncated
        loss_mask[i, :k] = 1.0
        if masks is not None:
            masks[i, :k] = np.stack(s.masks)
        if critic is not None:
            critic[i, :k] = np.stack(s.critic)
            boot_critic[i] = s.next_critic
        boot[i] = acting.inputs(s.next_obs[None])[0]
        for pos, final_obs, final_critic in s.truncations:
            trunc_index.append((i, pos))
            trunc_obs.append(acting.inputs(final_obs[None])[0])
            trunc_critic.append(final_critic)
    return Trajectories(
        episode_id=np.arange(first_episode_id, first_episode_id + n, dtype=np.int64),
        group_id=np.full(n, NO_GROUP, np.int64),
        agent_id=np.array([agent for agent, _ in rows], dtype=object),
        policy_id=np.full(n, policy, dtype=object),
        length=lengths,
        loss_mask=loss_mask,
        policy_version=versions,
        logprobs=logp,
        terminated=terminated,
        truncated=truncated,
        obs=obs,
        actions=actions,
        bootstrap_obs=boot,
        truncation_index=np.asarray(trunc_index, np.int64).reshape(-1, 2),
        truncation_obs=np.asarray(trunc_obs, np.float32).reshape(-1, d),
        action_mask=masks,
        critic_obs=critic,
        bootstrap_critic_obs=boot_critic,
        truncation_critic_obs=None
        if critic_dim is None
        else np.asarray(trunc_critic, np.float32).reshape(-1, critic_dim),
        rewards={"env": rewards},
    )


@ray.remote
class GameRunner(RunnerProcess, GameRunnerCore):
    """The Ray actor. ``sample`` returns 1 + (trainable policies) objects; ask with
    ``.options(num_returns=...)``."""

    def spaces(self) -> dict[str, Any]:
        return self.spaces_info()
