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

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from rlfabric import objectives, registry, rewards
from rlfabric.actors.llm_episodes import EpisodeRollouts
from rlfabric.actors.rollout_meta import (
    MAX_ERRORS_IN_META,
    encode_meta,
    group_statistics,
    process_means,
    step_credit_signal,
    sums_by_source,
)
from rlfabric.agent_loop import EpisodeLimits
from rlfabric.agent_rollout import (
    AgentSource,
)
from rlfabric.algorithms.record_rewards import outcome_rewards
from rlfabric.data import data_sources, row_metadata
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import load_tokenizer
from rlfabric.policies.served import GeneratorsFailed, PendingWeights, ServedLLMPolicy
from rlfabric.reward_config import parse_split
from rlfabric.reward_pool import RewardPool
from rlfabric.rewards import RewardInput, RewardResult
from rlfabric.rewards.process import split_completion
from rlfabric.rewards.shadow import sampled_groups, verdict_counts
from rlfabric.text_env import TextEnv, text_env_factory
from rlfabric.trajectory import Trajectories, from_token_sequences


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
    after: PendingWeights | None = None  # sent before its weights were loaded: generated with them all the same


class LLMRolloutCore(EpisodeRollouts):
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
        reward_gpus: float = 0.0,
        reward_resources: dict[str, float] | None = None,
        reward_placement: list[dict[str, Any]] | None = None,
        parts: bytes | None = None,
    ) -> None:
        """``text_env`` / ``agent``: where episodes come from when the run plays a text env or an outside agent
        (None: single-turn completions); ``process``: the ``rewards.process`` section (None: off); ``model_dir``:
        the policy's folder, whose tokenizer maps step boundaries to tokens when ``process["split"]`` cuts
        completions into steps; ``step_credit``: the learner's batch options when it credits steps
        (``grpo.step_credit``), so a group whose steps get advantages has signal even when its outcomes are equal
        (``step_credit_signal``); None: outcome rewards alone decide. ``reward_placement``: each reward worker's
        scheduling options (``ray.placement.rewards``), the training reward's workers first, then the shadow's;
        ``parts``: what the driver's user code added to ``rlfabric.objectives`` (a step credit)."""
        rewards.load_snapshot(reward_registry)
        objectives.load_snapshot(parts)
        self.pool = (
            RewardPool(
                reward_functions,
                num_reward_workers,
                reward_timeout_s,
                num_cpus_per_worker=reward_cpus,
                num_gpus_per_worker=reward_gpus,
                resources=reward_resources,
                snapshot=reward_registry,
                placement=(reward_placement or [])[:num_reward_workers],  # the shadow's bundle comes after these
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
                num_gpus_per_worker=reward_gpus,
                resources=reward_resources,
                snapshot=reward_registry,
                placement=(reward_placement or [])[num_reward_workers if reward_functions else 0 :],
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

    def take_replaced(self) -> list[str]:
        """The reward workers replaced since the last call, one line each, the shadow verifier's said so."""
        lines = self.pool.take_replaced() if self.pool is not None else []
        if self.shadow_pool is not None:
            lines += [f"shadow {line}" for line in self.shadow_pool.take_replaced()]
        return lines

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
        policy = ServedLLMPolicy(request.generators, request.params, request.timeout_s, g, request.after)
        try:
            acted = policy.act(prompt_ids)
        except GeneratorsFailed as failed:
            return {**meta, "generator_failures": failed.failures}, None
        sampled, texts, finish = acted.actions, acted.info["text"], acted.info["finish_reason"]
        generated = time.perf_counter()
        started = policy.generation_began(started)  # a rollout sent ahead waited for its weights first
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
            scored = [r.components for r in results if r.error is None]
            if any("correct" in c for c in scored):  # absent: no reward gives one, accuracy is n/a
                meta["correct_sum"] = float(sum(c.get("correct", 0.0) for c in scored))
            meta["reward_sum"] = float(scalar.sum())
            sources = data_sources(rows)
            if sources is not None:  # held-out rows of several data sources: their sums per source too
                reward_of = dict(zip(kept.tolist(), scalar.tolist(), strict=True))
                meta["by_source"] = sums_by_source(
                    sources,
                    [r.components if r.error is None else None for r in results],
                    [reward_of.get(i) for i in range(len(rows))],
                )
            return meta, None
        return meta, trajectories

    def reward_pids(self) -> list[int]:
        return [] if self.pool is None else self.pool.pids()

    def reward_workers(self) -> list[Any]:
        """The reward workers' handles, the training reward's then the shadow's (for the placement plan)."""
        return [w for pool in (self.pool, self.shadow_pool) if pool is not None for w in pool.workers]

    def shutdown(self) -> None:
        for pool in (self.pool, self.shadow_pool):
            if pool is not None:
                pool.shutdown()


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
        replaced = self.core.take_replaced()
        if replaced:  # printed by the driver, as generators' replacements are
            meta["reward_replaced"] = replaced
        return encode_meta(meta), trajectories

    def reward_pids(self) -> list[int]:
        return self.core.reward_pids()

    def reward_workers(self) -> list[Any]:
        return self.core.reward_workers()

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        self.core.shutdown()
