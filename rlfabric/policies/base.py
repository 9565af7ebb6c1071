"""The policy interface: what a rollout worker calls to turn a batch of observations into actions.

Every kind of policy sits behind it: a neural net acting inside the worker (``NeuralNetPolicy``, weight-synced by
version), a language model served by generator actors (``rlfabric.policies.served.ServedLLMPolicy``), a scripted
function (``ScriptedPolicy``); frozen snapshots and agent-to-policy maps build on the same call. A worker with many
episodes in flight batches their single requests into one call with ``rlfabric.policies.batching.ActBatcher``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass
class PolicyOutput:
    """One action per observation of the batch the policy was called on, in order.

    ``actions[i]``: an action array row (neural net) or the sampled token ids (language model).
    ``logprobs[i]``: the behaviour log-probability of that action (a scalar), or one per sampled token.
    ``versions[i]``: the policy version that chose it (trajectories carry it per step or token).
    ``info``: further per-observation columns (what the net saw after normalizing; decoded text, finish reason).
    """

    actions: Sequence[Any]
    logprobs: Sequence[Any]
    versions: Sequence[int]
    info: dict[str, Sequence[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.actions)
        columns = {"logprobs": self.logprobs, "versions": self.versions, **self.info}
        for name, column in columns.items():
            if len(column) != n:
                raise ValueError(f"PolicyOutput.{name} has {len(column)} entries for {n} actions")

    def __len__(self) -> int:
        return len(self.actions)

    def take(self, rows: slice) -> PolicyOutput:
        """The outputs of ``rows`` (a slice of the batch)."""
        return PolicyOutput(
            self.actions[rows],
            self.logprobs[rows],
            self.versions[rows],
            {k: v[rows] for k, v in self.info.items()},
        )


@runtime_checkable
class Policy(Protocol):
    """Chooses actions for a batch of observations. ``version`` is the newest version it has acted with (or
    installed), -1 before any."""

    version: int

    def act(self, observations: Sequence[Any]) -> PolicyOutput: ...


@runtime_checkable
class LocalPolicy(Policy, Protocol):
    """A policy whose weights live in the worker: the driver publishes a version and the worker installs it."""

    def set_weights(self, weights: Any) -> int: ...


class ScriptedPolicy:
    """A fixed rule as a policy: ``rule(observations) -> actions`` for a batch; log-probability 0 (the rule is
    deterministic) and a constant version. Opponents, baselines and tests use it."""

    def __init__(self, rule: Callable[[Sequence[Any]], Sequence[Any]], version: int = 0) -> None:
        self.rule = rule
        self.version = version

    def act(self, observations: Sequence[Any]) -> PolicyOutput:
        actions = self.rule(observations)
        n = len(actions)
        return PolicyOutput(actions, np.zeros(n, np.float32), np.full(n, self.version, np.int64))
