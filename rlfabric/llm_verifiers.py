"""A GRPO run on a ``verifiers`` environment (``env.verifiers``): its host actor started in the environment's own
Python packages, its dataset as the run's task rows, its rubric's weights as the reward weights, and the agent
function that rolls each episode out on the host through the rollout worker's endpoint
(``rlfabric.actors.verifiers_host``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import ray

from rlfabric.actor_slots import RunAbortedError, remote_cause
from rlfabric.actors.verifiers_host import HOST_NAME_PREFIX, VerifiersHost, verifiers_agent
from rlfabric.agents import Agent
from rlfabric.config import ConfigError
from rlfabric.grpo_config import LLMConfig
from rlfabric.llm_resources import SETUP_TIMEOUT_S


@dataclass
class VerifiersRun:
    """What the driver takes from a verifiers environment: its host actor, task rows and agent function."""

    host: Any
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    agent: Agent


def accuracy_function(weights: dict[str, float], asked: str) -> str:
    """The rubric function that decides held-out correctness: ``asked`` (``env.verifiers.accuracy``) when the
    rubric has it, else the first function with a nonzero weight; a ConfigError naming the field otherwise."""
    if asked:
        if asked not in weights:
            raise ConfigError(
                f"env.verifiers.accuracy = {asked!r} is not valid: the rubric's functions are {', '.join(weights)}"
            )
        return asked
    weighted = [name for name, w in weights.items() if w != 0]
    if not weighted:
        raise ConfigError("env.verifiers.id: the environment's rubric has no function with a nonzero weight")
    return weighted[0]


def start_verifiers_env(cfg: LLMConfig) -> VerifiersRun:
    """Start the host actor with ``env.verifiers.pip`` as its runtime env, load the environment there and read
    its rows and rubric (one error naming ``env.verifiers`` when it cannot). The rubric's weights become
    ``rewards.weights`` defaults (a weight given there wins), ``correct`` weighing 0 unless the rubric has it."""
    v = cfg.env.verifiers
    name = f"{HOST_NAME_PREFIX}{uuid.uuid4().hex[:8]}"
    runtime_env = {"pip": list(v.pip)} if v.pip else None
    # every episode a run can have in flight (training rollouts, the next ones under max_policy_lag, an
    # evaluation) holds one of the host's threads while it runs
    g, t = cfg.grpo, cfg.training
    threads = g.prompts_per_step * g.group_size * (1 + t.max_policy_lag) + cfg.data.num_eval * g.group_size + 16
    host = VerifiersHost.options(name=name, runtime_env=runtime_env, max_concurrency=threads).remote(v.id, dict(v.args))
    try:
        described = ray.get(host.describe.remote(cfg.data.num_train, cfg.data.num_eval), timeout=SETUP_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.kill(host, no_restart=True)
        raise RunAbortedError(
            f"env.verifiers.id = {v.id!r}: its actor did not load it within {SETUP_TIMEOUT_S:.0f}s "
            f"(installing env.verifiers.pip = {list(v.pip)} included)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - the environment's or its packages' failure: named, one line
        described = {"error": remote_cause(exc)}
    if "error" in described:
        ray.kill(host, no_restart=True)
        raise ConfigError(
            f"env.verifiers.id = {v.id!r}: loading it (with env.verifiers.pip = {list(v.pip)}) failed: "
            f"{described['error']}"
        )
    try:
        weights = described["weights"]
        accuracy = accuracy_function(weights, v.accuracy)
        if not described["train"] or not described["eval"]:
            raise ConfigError(
                f"env.verifiers.id = {v.id!r}: its dataset gave {len(described['train'])} training and "
                f"{len(described['eval'])} held-out rows; it needs both (data.num_train, data.num_eval)"
            )
    except ConfigError:
        stop_verifiers_env(host)
        raise
    for component, weight in weights.items():
        cfg.rewards.weights.setdefault(component, weight)
    if "correct" not in weights:
        cfg.rewards.weights.setdefault("correct", 0.0)  # added for eval_accuracy only, never a reward
    agent = verifiers_agent(name, accuracy, cfg.env.agent_timeout_s)
    return VerifiersRun(host, described["train"], described["eval"], agent)


def stop_verifiers_env(host: Any) -> None:
    """Run the environment's teardown handlers on its host, then end the host."""
    try:
        ray.get(host.close.remote(), timeout=15)
    except Exception:  # noqa: BLE001, S110 - killed below either way
        pass
    ray.kill(host, no_restart=True)
