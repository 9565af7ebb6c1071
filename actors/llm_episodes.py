"""The rollout worker's multi-turn half: episodes of a text env or an outside agent, played with the policy's turns
batched across them, scored by reward functions when the config lists them beside a text env
(``rlfabric.episode_rewards``), and assembled into one trajectory record with the metadata the driver reads.

``EpisodeRollouts`` is mixed into ``LLMRolloutCore`` (``actors/llm_rollout.py``), which holds what it uses: the
text env's factory and chat tokens, the agent, the prompt sets, the reward pool and its lock, and the scalar
reward and step signal of a record.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from rlfabric.actors.rollout_meta import (
    MAX_ERRORS_IN_META,
    episodes_meta,
    last_row_of_each_episode,
    sums_by_source,
)
from rlfabric.agent_loop import Episode, episodes_to_trajectories, run_episodes
from rlfabric.agent_rollout import agent_trajectories, episode_versions, play_agents, transcript
from rlfabric.agents import AgentEpisode
from rlfabric.data import data_sources, row_metadata
from rlfabric.episode_rewards import score_episodes
from rlfabric.policies.batching import ActBatcher
from rlfabric.policies.served import GeneratorsFailed, ServedLLMPolicy
from rlfabric.tools import ERROR_KINDS
from rlfabric.trajectory import Trajectories


def episode_transcript(episode: Episode, separator: str = " | ") -> str:
    """A text env's episode as the policy saw it, on one line, for the samples a run shows: the env's opening
    (``env: ...``), then each turn (``policy: ...``) and the env's reply to it (none after the last)."""
    lines = [f"env: {episode.opening}"] if episode.opening else []
    for turn, text in enumerate(episode.texts):
        lines.append(f"policy: {text}")
        reply = episode.observations[turn] if turn < len(episode.observations) else ""
        if reply:
            lines.append(f"env: {reply}")
    return separator.join(lines)


class EpisodeRollouts:
    """``rollout`` on a text env (``_play``) or an outside agent (``_play_agents``); see the module docstring."""

    # set by LLMRolloutCore
    text_env: Any
    agent: Any
    chat: Any
    make_env: Any
    play_agent: Any
    pool: Any
    lock: Any
    prompt_key: str
    prompt_sets: dict[str, Any]

    def scalar_rewards(self, trajectories: Trajectories) -> np.ndarray:
        raise NotImplementedError

    def step_signal(self, trajectories: Trajectories, scalar: np.ndarray) -> np.ndarray | None:
        raise NotImplementedError

    def _episode_tasks(self, request: Any) -> tuple[list[dict[str, Any]], dict[str, Any], ServedLLMPolicy]:
        """The request's tasks (each index's row, ``group_size`` times: one episode each), its metadata so far, and
        the policy on its generators."""
        rows = self.prompt_sets[request.prompt_set].rows
        tasks = [rows[i] for i in request.indices for _ in range(request.group_size)]
        meta: dict[str, Any] = {**request.meta, "samples": len(tasks)}
        return tasks, meta, ServedLLMPolicy(request.generators, request.params, request.timeout_s, after=request.after)

    def _play(self, request: Any) -> tuple[dict[str, Any], Trajectories | None]:
        """``rollout`` on a text env: ``group_size`` episodes per task row, all in flight at once, the policy's
        turns batched across them; the env's reward components are the samples' rewards, with the scores of
        ``rewards.functions`` on their turns when the config lists any."""
        assert self.text_env is not None and self.chat is not None and self.make_env is not None
        source = self.text_env
        started = time.perf_counter()
        tasks, meta, policy = self._episode_tasks(request)
        try:
            episodes = asyncio.run(run_episodes(self.make_env, tasks, ActBatcher(policy), self.chat, source.limits))
        except GeneratorsFailed as failed:
            return {**meta, "generator_failures": failed.failures}, None
        played = time.perf_counter()
        reward_restarts, reward_time_s, group_ids, episode_ids = self._score_and_number(episodes, tasks, request)
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
                # episodes interleave generation and env steps; a rollout sent ahead waited for its weights first
                "generate_time_s": played - policy.generation_began(started),
                "reward_restarts": reward_restarts,
                "reward_time_s": reward_time_s,
            }
        )
        outcomes = [(episode_transcript(e), e.rewards, e.error) for e in episodes]
        return self._episodes_outcome(meta, request, tasks, outcomes, scalar, trajectories)

    def _score_and_number(
        self, episodes: Any, tasks: list[dict[str, Any]], request: Any
    ) -> tuple[int, float, np.ndarray, list[int]]:
        """Score the played episodes when the run lists reward functions; return (reward workers replaced, seconds
        spent scoring, each episode's group id, each episode's id)."""
        g, started = request.group_size, time.perf_counter()
        restarts = self._score_episodes(episodes, tasks, g) if self.pool is not None else 0
        group_ids = np.repeat(np.arange(request.first_group, request.first_group + len(request.indices)), g)
        episode_ids = [request.first_group * g + i for i in range(len(episodes))]
        return restarts, time.perf_counter() - started, group_ids, episode_ids

    def _score_episodes(
        self, episodes: list[Episode] | list[AgentEpisode], tasks: list[dict[str, Any]], group_size: int
    ) -> int:
        """``score_episodes`` on this worker's reward services; returns the reward workers replaced meanwhile."""
        assert self.pool is not None
        with self.lock:
            restarts = self.pool.worker_restarts
            score_episodes(self.pool.score, episodes, tasks, group_size, self.prompt_key)
            return self.pool.worker_restarts - restarts

    def _play_agents(self, request: Any) -> tuple[dict[str, Any], Trajectories | None]:
        """``rollout`` with an outside agent (``rlfabric.agent_rollout``): ``group_size`` episodes per task row,
        all in flight at once on an endpoint of this rollout, their calls batched; the agent's returned components
        are the rewards, with the scores of ``rewards.functions`` when the config lists any, on every exact segment
        (row) of its episode."""
        assert self.agent is not None and self.chat is not None
        source = self.agent
        started = time.perf_counter()
        tasks, meta, policy = self._episode_tasks(request)
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
        played = time.perf_counter()
        reward_restarts, reward_time_s, group_ids, episode_ids = self._score_and_number(episodes, tasks, request)
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
                # episodes interleave calls and the agents' work; a rollout sent ahead waited for its weights first
                "generate_time_s": played - policy.generation_began(started),
                "reward_restarts": reward_restarts,
                "reward_time_s": reward_time_s,
            }
        )
        outcomes = [(transcript(e.trace), e.rewards, e.error) for e in episodes]
        return self._episodes_outcome(meta, request, tasks, outcomes, scalar, trajectories)

    def _episodes_outcome(
        self,
        meta: dict[str, Any],
        request: Any,
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
            # always: an env gives 'correct' on the episodes it counts right only, so its absence is a wrong answer
            meta["correct_sum"] = float(sum(c.get("correct", 0.0) for _, c, error in outcomes if error is None))
            episode_rewards = scalar[last_row_of_each_episode(trajectories.episode_id)]
            meta["reward_sum"] = float(episode_rewards.sum())
            ok = [error is None for _, _, error in outcomes]
            sources = data_sources(tasks)
            # the record holds the episodes that did not fail, in order
            if sources is not None and sum(ok) == len(episode_rewards):
                scored = iter(episode_rewards.tolist())
                meta["by_source"] = sums_by_source(
                    sources,
                    [components if good else None for (_, components, _), good in zip(outcomes, ok, strict=True)],
                    [next(scored) if good else None for good in ok],
                )
            return meta, None
        return meta, trajectories
