"""LLMRolloutWorker: turns prompt indices into scored trajectory records, next to the data.

The rollout side of LLM post-training. For one request (prompt indices, group size, sampling parameters and the
generators to use) the worker

1. asks the LLM policy, served by generator actors (``ServedLLMPolicy``), for completions of the prompts: a
   whole group per generator, one deadline over the calls;
2. scores whole groups on its reward services (``RewardPool``: deadlines, replacement of dead or poisoned
   services) and keeps the named components; with ``rewards.process.split`` it first cuts each completion into
   steps (``rlfabric.rewards.process.split_completion``, with the policy's tokenizer), so process rewards score
   each step and their components land on the steps' token spans, the outcome components on the last (answer)
   span; on a text env the env plays the episodes and gives per-turn components, and reward functions, when
   the config lists them, score each finished episode as one sample (``rlfabric.episode_rewards``);
3. assembles one ``Trajectories`` record of the scored samples and returns it as an ObjectRef beside small
   metadata: counts, versions and per-group reward statistics, which is all the driver reads.

A generator that fails or misses its deadline fails the whole request: the metadata names it (slot and
generation) and the driver replaces it and asks again. The worker never decides policy (which groups to train,
staleness): the driver does that from the metadata.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from rlfabric import registry, rewards
from rlfabric.agent_loop import Episode, EpisodeLimits, episodes_to_trajectories, run_episodes
from rlfabric.agent_rollout import (
    REFUSED_COUNTS,
    AgentSource,
    agent_trajectories,
    episode_versions,
    play_agents,
    transcript,
)
from rlfabric.algorithms.grpo import group_has_signal
from rlfabric.compact import FloatFields
from rlfabric.data import row_metadata
from rlfabric.episode_rewards import score_episodes
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import load_tokenizer
from rlfabric.models.llm_batch import outcome_rewards, step_credit_advantages
from rlfabric.policies.batching import ActBatcher
from rlfabric.policies.served import GeneratorsFailed, ServedLLMPolicy
from rlfabric.reward_config import parse_split
from rlfabric.reward_pool import RewardPool
from rlfabric.rewards import RewardInput, RewardResult
from rlfabric.rewards.process import split_completion
from rlfabric.rewards.shadow import sampled_groups, verdict_counts
from rlfabric.text_env import TextEnv, text_env_factory
from rlfabric.tools import ERROR_KINDS
from rlfabric.trajectory import Trajectories, from_token_sequences

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


@dataclass
class PromptSet:
    """Prompts the worker can be asked for by index: dataset rows (text and metadata) and their token ids."""

    rows: list[dict[str, Any]]
    token_ids: list[list[int]]


@dataclass
class TextEnvSource:
    """Where episodes come from when the run trains on a text env (``env.id``): the env spec and kwargs, the
    limits of an episode, the driver's env registrations, and the model folder whose tokenizer formats turns."""

    spec: str
    kwargs: dict[str, Any]
    limits: EpisodeLimits
    registry: bytes
    model_dir: str


@dataclass
class RolloutRequest:
    """What one rollout generates: ``indices`` of ``prompt_set``, each ``group_size`` times."""

    prompt_set: str  # "train" or "eval"
    indices: list[int]
    group_size: int
    params: dict[str, Any]  # SamplingParams fields
    first_group: int  # group ids first_group, first_group + 1, ... in order of ``indices``
    generators: list[tuple[int, int, Any]]  # (slot, generation, actor handle) of each generator to use
    timeout_s: float  # the generation deadline
    keep_samples: int = 0  # eval: completions to return in the metadata (text, components, error)
    meta: dict[str, Any] = field(default_factory=dict)  # echoed back (the driver's bookkeeping)


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
    signal = group_has_signal(torch.from_numpy(rewards), torch.tensor(group_ids)).numpy()
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
    means, and the record's size. The rewards came with the episodes: no reward service ran."""
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


class LLMRolloutCore:
    """The worker's logic without the actor wrapper (its reward services are Ray actors all the same)."""

    def __init__(
        self,
        *,
        reward_functions: list[dict[str, Any]],
        reward_weights: dict[str, float],
        num_reward_workers: int,
        reward_timeout_s: float,
        reward_cpus: float,
        reward_registry: bytes,
        prompt_key: str,
        text_env: TextEnvSource | None = None,
        agent: AgentSource | None = None,
        efficiency: dict[str, Any] | None = None,
        combine: dict[str, Any] | None = None,
        shadow: dict[str, Any] | None = None,
        process: dict[str, Any] | None = None,
        model_dir: str | None = None,
        step_credit: dict[str, Any] | None = None,
    ) -> None:
        """``text_env`` / ``agent``: where episodes come from when the run plays a text env or an outside agent
        (None: single-turn completions); ``process``: the ``rewards.process`` section (None: off); ``model_dir``:
        the policy's folder, whose tokenizer maps step boundaries to tokens when ``process["split"]`` cuts
        completions into steps; ``step_credit``: the learner's batch options when it credits steps
        (``grpo.step_credit``), so a group whose steps get advantages has signal even when its outcomes are equal
        (``step_credit_signal``); None: outcome rewards alone decide."""
        rewards.load_snapshot(reward_registry)
        self.pool = (
            RewardPool(
                reward_functions,
                num_reward_workers,
                reward_timeout_s,
                num_cpus_per_worker=reward_cpus,
                snapshot=reward_registry,
            )
            if reward_functions
            else None  # a text env or an agent gives the rewards itself
        )
        self.text_env = text_env
        self.agent = agent
        self.chat: ChatTokens | None = None
        self.make_env: Callable[[], TextEnv] | None = None
        if text_env is not None:
            registry.load_snapshot(text_env.registry)
            self.chat = ChatTokens(load_tokenizer(text_env.model_dir))
            self.make_env = text_env_factory(text_env.spec, text_env.kwargs)
        if agent is not None:
            self.chat = ChatTokens(load_tokenizer(agent.model_dir))
            self.play_agent = agent.load()
        self.weights = reward_weights
        self.step_credit = step_credit
        self.efficiency = efficiency if efficiency and efficiency["weight"] > 0 else None
        self.combine = combine
        self.shadow = shadow if shadow and shadow["functions"] else None
        self.shadow_pool = (
            RewardPool(
                self.shadow["functions"],
                1,
                reward_timeout_s,
                num_cpus_per_worker=reward_cpus,
                snapshot=reward_registry,
            )
            if self.shadow
            else None  # a second reward, never used for learning (rlfabric.rewards.shadow)
        )
        self.prompt_key = prompt_key
        self.split = process["split"] if process and parse_split(process["split"])[0] != "none" else None
        self.decode: Callable[[Any], str] | None = None
        if self.split is not None and text_env is None:
            if model_dir is None:
                raise ValueError(f"rewards.process.split = {self.split!r} needs the policy's tokenizer: no model_dir")
            tokenizer = load_tokenizer(model_dir)
            self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # as the generator decodes
        self.prompt_sets: dict[str, PromptSet] = {}
        self.lock = threading.Lock()  # the reward pool is not thread-safe; rollouts run concurrently

    def scalar_rewards(self, trajectories: Trajectories) -> np.ndarray:
        """[N] the scalar reward the learner's advantages use (``outcome_rewards``: the combined components plus
        the efficiency penalty), so the group statistics the driver filters on see what the learner will."""
        return outcome_rewards(trajectories, self.weights, self.combine, self.efficiency)[0]

    def step_signal(self, trajectories: Trajectories, scalar: np.ndarray) -> np.ndarray | None:
        """The rows whose groups' steps get advantages, when the learner credits steps."""
        return step_credit_signal(trajectories, scalar, self.step_credit) if self.step_credit else None

    def set_prompts(self, name: str, prompts: PromptSet) -> int:
        self.prompt_sets[name] = prompts
        return len(prompts.rows)

    def _check_with_shadow(
        self, inputs: list[RewardInput], results: list[RewardResult], group_size: int, seed: int
    ) -> dict[str, int]:
        """The shadow verifier's verdicts against the training reward's on a sample of the groups (samples either
        failed to score are left out): ``rlfabric.rewards.shadow.verdict_counts``."""
        assert self.shadow is not None and self.shadow_pool is not None
        sh = self.shadow
        groups = sampled_groups(len(inputs) // group_size, sh["sample"], seed)
        picked = [[inputs[g * group_size + k] for k in range(group_size)] for g in groups]
        with self.lock:
            checked = self.shadow_pool.score(picked)
        train, shadow = [], []
        for g, verdicts in zip(groups, checked, strict=True):
            for k, verdict in enumerate(verdicts):
                trained = results[g * group_size + k]
                if verdict.error is None and trained.error is None:
                    train.append(trained.components.get(sh["train_component"], 0.0) > sh["train_threshold"])
                    shadow.append(verdict.components.get(sh["component"], 0.0) > sh["threshold"])
        return verdict_counts(np.array(train, bool), np.array(shadow, bool))

    def _inputs(
        self,
        rows: list[dict],
        sampled: list[list[int]],
        texts: list[str],
        finish: list[str],
        steps: list[tuple[list[str], list[int]]] | None = None,
    ) -> list[RewardInput]:
        return [
            RewardInput(
                prompt=row[self.prompt_key],
                completion=text,
                metadata=row_metadata(row, self.prompt_key),
                finish_reason=reason,
                num_tokens=len(ids),
                steps=None if steps is None else steps[i][0],
            )
            for i, (row, ids, text, reason) in enumerate(zip(rows, sampled, texts, finish, strict=True))
        ]

    def _split(self, sampled: list[list[int]], texts: list[str]) -> list[tuple[list[str], list[int]]] | None:
        """Each completion's (step texts, step token ends) under ``rewards.process.split``; None when it is off."""
        if self.split is None or self.decode is None:
            return None
        return [split_completion(ids, text, self.decode, self.split) for ids, text in zip(sampled, texts, strict=True)]

    def _score(self, inputs: list[RewardInput], group_size: int) -> tuple[list[RewardResult], int]:
        groups = [inputs[i : i + group_size] for i in range(0, len(inputs), group_size)]
        assert self.pool is not None  # single-turn runs always have reward functions (config validation)
        with self.lock:
            restarts = self.pool.worker_restarts
            results = [r for g in self.pool.score(groups) for r in g]
            return results, self.pool.worker_restarts - restarts

    def rollout(self, request: RolloutRequest) -> tuple[dict[str, Any], Trajectories | None]:
        """(metadata, record of the scored samples) for one request; see the module docstring."""
        if self.text_env is not None:
            return self._play(request)
        if self.agent is not None:
            return self._play_agents(request)
        started = time.perf_counter()
        prompts = self.prompt_sets[request.prompt_set]
        g = request.group_size
        rows = [prompts.rows[i] for i in request.indices for _ in range(g)]
        prompt_ids = [prompts.token_ids[i] for i in request.indices for _ in range(g)]
        meta: dict[str, Any] = {**request.meta, "samples": len(rows)}
        policy = ServedLLMPolicy(request.generators, request.params, request.timeout_s, keep_together=g)
        try:
            acted = policy.act(prompt_ids)
        except GeneratorsFailed as failed:
            return {**meta, "generator_failures": failed.failures}, None
        sampled, texts, finish = acted.actions, acted.info["text"], acted.info["finish_reason"]
        generated = time.perf_counter()
        steps = self._split(sampled, texts)
        inputs = self._inputs(rows, sampled, texts, finish, steps)
        results, restarts = self._score(inputs, g)
        ok = np.array([r.error is None for r in results], bool)
        group_ids = np.repeat(np.arange(request.first_group, request.first_group + len(request.indices)), g)
        components = sorted({k for r in results if r.error is None for k in r.components})
        final = {k: [r.components.get(k, 0.0) for r, good in zip(results, ok, strict=True) if good] for k in components}
        kept = np.flatnonzero(ok)
        process = [results[i].step_components for i in kept]
        trajectories = from_token_sequences(
            [prompt_ids[i] for i in kept],
            [sampled[i] for i in kept],
            [acted.logprobs[i] for i in kept],
            [[acted.versions[i]] * len(sampled[i]) for i in kept],
            episode_ids=[request.first_group * g + int(i) for i in kept],
            group_ids=group_ids[kept],
            final_rewards=final,
            truncated=[finish[i] == "length" for i in kept],
            step_ends=None if steps is None else [steps[i][1] for i in kept],
            step_rewards=process if any(p is not None for p in process) else None,
        )
        scalar = self.scalar_rewards(trajectories)
        versions = np.array([acted.versions[i] for i in kept], np.int64)
        meta.update(
            {
                "rows": len(kept),
                "failed": int((~ok).sum()),
                "tokens": int(sum(len(ids) for ids in sampled)),
                "group_stats": group_statistics(
                    trajectories.group_id,
                    scalar,
                    versions,
                    list(range(request.first_group, group_ids[-1] + 1)),
                    self.step_signal(trajectories, scalar),
                ),
                "component_means": {
                    **({k: float(np.mean(v)) for k, v in final.items()} if len(kept) else {}),
                    **process_means(process),
                },
                "response_length_mean": float(np.mean([len(ids) for ids in sampled])),
                "reward_restarts": restarts,
                "record_bytes": trajectories.nbytes(),
                "generate_time_s": generated - started,
                "reward_time_s": time.perf_counter() - generated,
            }
        )
        if self.shadow is not None and request.prompt_set == "train":
            meta["shadow"] = self._check_with_shadow(inputs, results, g, request.first_group)
        errors = list(dict.fromkeys(r.error for r in results if r.error is not None))[:MAX_ERRORS_IN_META]
        if errors:
            meta["errors"] = errors
        if request.keep_samples:
            meta["shown"] = [
                {
                    "prompt": row[self.prompt_key],
                    "completion": text,
                    "metadata": row_metadata(row, self.prompt_key),
                    "components": r.components,
                    "error": r.error,
                    **({} if steps is None else {"steps": steps[i][0]}),
                    **({} if r.step_components is None else {"step_components": r.step_components}),
                }
                for i, (row, text, r) in enumerate(list(zip(rows, texts, results, strict=True))[: request.keep_samples])
            ]
        if request.prompt_set == "eval":  # an evaluation reports sums over its samples; nobody trains on them
            meta["correct_sum"] = float(sum(r.components.get("correct", 0.0) for r in results if r.error is None))
            meta["reward_sum"] = float(scalar.sum())
            return meta, None
        return meta, trajectories

    def _play(self, request: RolloutRequest) -> tuple[dict[str, Any], Trajectories | None]:
        """``rollout`` on a text env: ``group_size`` episodes per task row, all in flight at once, the policy's
        turns batched across them; the env's reward components are the samples' rewards."""
        assert self.text_env is not None and self.chat is not None and self.make_env is not None
        source, g = self.text_env, request.group_size
        started = time.perf_counter()
        tasks = [self.prompt_sets[request.prompt_set].rows[i] for i in request.indices for _ in range(g)]
        meta: dict[str, Any] = {**request.meta, "samples": len(tasks)}
        policy = ServedLLMPolicy(request.generators, request.params, request.timeout_s)
        try:
            episodes = asyncio.run(run_episodes(self.make_env, tasks, ActBatcher(policy), self.chat, source.limits))
        except GeneratorsFailed as failed:
            return {**meta, "generator_failures": failed.failures}, None
        played = time.perf_counter()
        if self.pool is not None:
            meta["reward_restarts"] = self._score_episodes(episodes, tasks, g)
            meta["reward_time_s"] = time.perf_counter() - played
        group_ids = np.repeat(np.arange(request.first_group, request.first_group + len(request.indices)), g)
        episode_ids = [request.first_group * g + i for i in range(len(episodes))]
        trajectories = episodes_to_trajectories(episodes, episode_ids, group_ids)
        kept = [e for e in episodes if e.error is None]
        scalar = self.scalar_rewards(trajectories)
        versions = np.array([min((t.version for t in e.turns), default=-1) for e in kept], np.int64)
        sampled = [sum(len(t.sampled) for t in e.turns) for e in episodes]
        groups = list(range(request.first_group, int(group_ids[-1]) + 1))
        failed_episodes, step_signal = len(episodes) - len(kept), self.step_signal(trajectories, scalar)
        meta.update(
            {
                **episodes_meta(trajectories, scalar, versions, sampled, failed_episodes, groups, step_signal),
                "turns": sum(len(e.turns) for e in episodes),
                "env_errors": sum(e.env_errors for e in episodes),
                "tool_calls": sum(e.tool_calls for e in episodes),
                "solved_episodes": sum(e.rewards.get("correct", 0.0) > 0 for e in kept),
                "solved_tool_calls": sum(e.tool_calls for e in kept if e.rewards.get("correct", 0.0) > 0),
                "mixed_version_episodes": sum(len({t.version for t in e.turns}) > 1 for e in kept),
                **{
                    f"invalid_tool_calls_{kind}": sum(e.invalid_tool_calls.get(kind, 0) for e in episodes)
                    for kind in ERROR_KINDS
                },
                "generate_time_s": played - started,  # episodes interleave generation and env steps
            }
        )
        outcomes = [(" | ".join(e.texts), e.rewards, e.error) for e in episodes]
        return self._episodes_outcome(meta, request, tasks, outcomes, scalar, trajectories)

    def _score_episodes(self, episodes: list[Episode], tasks: list[dict[str, Any]], group_size: int) -> int:
        """``score_episodes`` on this worker's reward services; returns the reward workers replaced meanwhile."""
        assert self.pool is not None
        with self.lock:
            restarts = self.pool.worker_restarts
            score_episodes(self.pool.score, episodes, tasks, group_size, self.prompt_key)
            return self.pool.worker_restarts - restarts

    def _play_agents(self, request: RolloutRequest) -> tuple[dict[str, Any], Trajectories | None]:
        """``rollout`` with an outside agent (``rlfabric.agent_rollout``): ``group_size`` episodes per task row,
        all in flight at once on an endpoint of this rollout, their calls batched; the agent's returned components
        are the rewards, on every exact segment (row) of its episode."""
        assert self.agent is not None and self.chat is not None
        source, g = self.agent, request.group_size
        started = time.perf_counter()
        tasks = [self.prompt_sets[request.prompt_set].rows[i] for i in request.indices for _ in range(g)]
        meta: dict[str, Any] = {**request.meta, "samples": len(tasks)}
        policy = ServedLLMPolicy(request.generators, request.params, request.timeout_s)
        try:
            episodes, refused = asyncio.run(
                play_agents(
                    self.play_agent,
                    tasks,
                    self.chat,
                    batcher=ActBatcher(policy),
                    tool_parser=source.tool_parser,
                    deadline_s=source.deadline_s,
                    max_context_tokens=source.max_context_tokens,
                )
            )
        except GeneratorsFailed as failed:
            return {**meta, "generator_failures": failed.failures}, None
        group_ids = np.repeat(np.arange(request.first_group, request.first_group + len(request.indices)), g)
        episode_ids = [request.first_group * g + i for i in range(len(episodes))]
        trajectories = agent_trajectories(episodes, episode_ids, group_ids)
        kept = [e for e in episodes if e.error is None]
        scalar = self.scalar_rewards(trajectories)
        versions = episode_versions(episodes)
        sampled = [sum(len(t.sampled) for s in e.trace.segments for t in s.turns) for e in episodes]
        solved = [e for e in kept if e.rewards.get("correct", 0.0) > 0]
        groups = list(range(request.first_group, int(group_ids[-1]) + 1))
        failed_episodes, step_signal = len(episodes) - len(kept), self.step_signal(trajectories, scalar)
        meta.update(
            {
                **episodes_meta(trajectories, scalar, versions, sampled, failed_episodes, groups, step_signal),
                "turns": sum(e.trace.calls for e in episodes),
                "tool_calls": sum(e.trace.tool_calls for e in episodes),
                "solved_episodes": len(solved),
                "solved_tool_calls": sum(e.trace.tool_calls for e in solved),
                "mixed_version_episodes": sum(
                    len({t.version for s in e.trace.segments for t in s.turns}) > 1 for e in kept
                ),
                "rewrites": sum(e.trace.rewrites for e in episodes),
                **refused,
                "generate_time_s": time.perf_counter() - started,  # episodes interleave calls and the agents' work
            }
        )
        outcomes = [(transcript(e.trace), e.rewards, e.error) for e in episodes]
        return self._episodes_outcome(meta, request, tasks, outcomes, scalar, trajectories)

    def _episodes_outcome(
        self,
        meta: dict[str, Any],
        request: RolloutRequest,
        tasks: list[dict[str, Any]],
        outcomes: list[tuple[str, dict[str, float], str | None]],
        scalar: np.ndarray,
        trajectories: Trajectories,
    ) -> tuple[dict[str, Any], Trajectories | None]:
        """What a rollout of multi-turn episodes returns, given each episode's (transcript, reward components,
        error): the first errors and the samples asked for in the metadata; an evaluation's sums instead of the
        record."""
        errors = list(dict.fromkeys(error for _, _, error in outcomes if error is not None))[:MAX_ERRORS_IN_META]
        if errors:
            meta["errors"] = errors
        if request.keep_samples:
            meta["shown"] = [
                {
                    "prompt": task.get(self.prompt_key, ""),
                    "completion": text,
                    "metadata": row_metadata(task, self.prompt_key),
                    "components": components,
                    "error": error,
                }
                for task, (text, components, error) in list(zip(tasks, outcomes, strict=True))[: request.keep_samples]
            ]
        if request.prompt_set == "eval":
            meta["correct_sum"] = float(sum(c.get("correct", 0.0) for _, c, error in outcomes if error is None))
            meta["reward_sum"] = float(scalar[last_row_of_each_episode(trajectories.episode_id)].sum())
            return meta, None
        return meta, trajectories

    def reward_pids(self) -> list[int]:
        return [] if self.pool is None else self.pool.pids()

    def shutdown(self) -> None:
        for pool in (self.pool, self.shadow_pool):
            if pool is not None:
                pool.shutdown()


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


@ray.remote(max_concurrency=8)
class LLMRolloutWorker:
    """The Ray actor (threaded: several rollouts and an evaluation can be in flight at once)."""

    def __init__(self, **kwargs: Any) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.core = LLMRolloutCore(**kwargs)

    def set_prompts(self, name: str, prompts: PromptSet) -> int:
        return self.core.set_prompts(name, prompts)

    @ray.method(num_returns=2)
    def rollout(self, request: RolloutRequest) -> tuple[tuple, Trajectories | None]:
        """(metadata encoded for the driver, ``decode_meta`` reads it; the record, or None)."""
        meta, trajectories = self.core.rollout(request)
        return encode_meta(meta), trajectories

    def reward_pids(self) -> list[int]:
        return self.core.reward_pids()

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        self.core.shutdown()
