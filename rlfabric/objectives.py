"""The GRPO family's named parts: advantage estimators, policy-loss ratios, policy losses, loss aggregations, KL
estimators, learning-rate schedules.

One source of the valid names. Config validation checks a name against its table here, the docs test checks that
docs/config.md lists every name, and the learner's math (``rlfabric.algorithms.grpo``) resolves the name to the
pure function that implements it. Each entry names that function as ``"package.module:function"``, imported
only when it runs, so validating a config never imports torch; the function's docstring carries the formula.

A new part is one pure function and one ``add`` call, e.g. an advantage estimator
``fn(rewards [N], group_ids [N], *, scale_by_std) -> advantages [N]``::

    from rlfabric.objectives import ADVANTAGE_ESTIMATORS
    ADVANTAGE_ESTIMATORS.add("my_baseline", "my_package.advantages:my_baseline", "reward minus a learned baseline")

in a module the run imports (``rlfabric train ... --import my_package.advantages``). The learners and rollout
workers are other processes: the driver's additions reach them with the function itself (``snapshot``, through
``rlfabric.shipping``: by value where its module is not installed), so the module need not be importable there.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlfabric.config_base import ConfigError


@dataclass(frozen=True)
class Part:
    name: str
    target: str  # "package.module:function"
    summary: str  # one line: what it computes (docs and errors)


class PartTable:
    """Names of one kind of part, set by one config field, each resolving to its function."""

    def __init__(self, kind: str, field: str, signature: str) -> None:
        self.kind, self.field, self.signature = kind, field, signature
        self._parts: dict[str, Part] = {}
        self._resolved: dict[str, Callable[..., Any]] = {}

    def add(self, name: str, target: str, summary: str) -> None:
        """Register ``name`` for the function at ``target`` ("package.module:function")."""
        module, _, function = target.partition(":")
        if not name or not module or not function:
            raise ValueError(f"{self.kind} {name!r}: target {target!r} must be 'package.module:function'")
        self._parts[name] = Part(name, target, summary)
        self._resolved.pop(name, None)

    def install(self, part: Part, fn: Callable[..., Any] | None) -> None:
        """Add a part shipped from another process (``snapshot``), with its function where that came along."""
        self.add(part.name, part.target, part.summary)
        if fn is not None:
            self._resolved[part.name] = fn

    def remove(self, name: str) -> None:
        """Forget ``name`` (a no-op for a name never added)."""
        self._parts.pop(name, None)
        self._resolved.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._parts)

    def parts(self) -> tuple[Part, ...]:
        return tuple(self._parts.values())

    def check(self, name: str) -> None:
        """Raise a one-line ConfigError naming the field and the valid names when ``name`` is not one."""
        if name not in self._parts:
            close = difflib.get_close_matches(name, list(self._parts), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{self.field} = {name!r} is not valid{hint}: must be one of {', '.join(self._parts)}")

    def resolve(self, name: str) -> Callable[..., Any]:
        """The function registered under ``name`` (imported at the first call)."""
        if name not in self._resolved:
            if name not in self._parts:
                raise ValueError(f"unknown {self.kind} {name!r}; allowed: {', '.join(self._parts)}")
            module, _, function = self._parts[name].target.partition(":")
            self._resolved[name] = getattr(importlib.import_module(module), function)
        return self._resolved[name]


_MATH = "rlfabric.algorithms.grpo"

ADVANTAGE_ESTIMATORS = PartTable(
    "advantage estimator", "grpo.advantage", "fn(rewards [N], group_ids [N], *, scale_by_std) -> advantages [N]"
)
ADVANTAGE_ESTIMATORS.add("grpo", f"{_MATH}:grpo_advantages", "group mean and std (scale_by_std false: Dr. GRPO)")
ADVANTAGE_ESTIMATORS.add("rloo", f"{_MATH}:rloo_advantages", "leave-one-out group mean")
ADVANTAGE_ESTIMATORS.add("reinforce_pp", f"{_MATH}:reinforce_pp_advantages", "batch mean and std")
ADVANTAGE_ESTIMATORS.add(
    "reinforce_pp_baseline",
    f"{_MATH}:reinforce_pp_baseline_advantages",
    "group mean removed, then batch mean and std",
)

POLICY_RATIOS = PartTable(
    "policy-loss ratio", "grpo.ratio_level", "fn(new_logp [N, T], old_logp [N, T], mask [N, T]) -> log ratio [N, T]"
)
POLICY_RATIOS.add("token", f"{_MATH}:token_log_ratio", "per-token ratio (PPO / GRPO / DAPO clipped surrogate)")
POLICY_RATIOS.add("sequence", f"{_MATH}:sequence_log_ratio", "length-normalised sequence ratio (GSPO)")

POLICY_LOSSES = PartTable(
    "policy loss",
    "grpo.policy_loss",
    "fn(new_logp [N, T], old_logp [N, T], advantages [N] or [N, T], mask [N, T], *, clip_low, clip_high, "
    "ratio_level) -> (loss [N, T], clip fraction); 0 where the advantage is 0, or set skip_zero_advantage_rows: false",
)
POLICY_LOSSES.add("clip", f"{_MATH}:clipped_policy_loss", "PPO's clipped surrogate (PPO, GRPO, DAPO, GSPO)")
POLICY_LOSSES.add("cispo", f"{_MATH}:cispo_policy_loss", "REINFORCE with clipped, detached importance weights (CISPO)")
POLICY_LOSSES.add(
    "dual_clip", f"{_MATH}:dual_clip_policy_loss", "PPO-clip with a negative advantage's loss capped at 3|A| (verl)"
)

LOSS_AGGREGATIONS = PartTable(
    "loss aggregation",
    "grpo.loss_aggregation",
    "fn(loss [N, T], mask [N, T], norm_length) -> (numerator, denominator), both additive over micro-batches",
)
LOSS_AGGREGATIONS.add("token_mean", f"{_MATH}:token_mean", "over all tokens of the batch (DAPO)")
LOSS_AGGREGATIONS.add("seq_mean_token_mean", f"{_MATH}:seq_mean_token_mean", "per sequence, then over sequences")
LOSS_AGGREGATIONS.add(
    "seq_mean_token_sum_norm",
    f"{_MATH}:seq_mean_token_sum_norm",
    "token sum / sampling.max_new_tokens, then over sequences (Dr. GRPO)",
)

KL_ESTIMATORS = PartTable("KL estimator", "grpo.kl_estimator", "fn(logp [N, T], ref_logp [N, T]) -> kl [N, T]")
KL_ESTIMATORS.add("k1", f"{_MATH}:kl_k1", "logp - ref_logp (unbiased, can be negative)")
KL_ESTIMATORS.add("k3", f"{_MATH}:kl_k3", "exp(d) - d - 1 (unbiased, nonnegative)")

_SCHEDULES = "rlfabric.algorithms.lr_schedules"
LR_SCHEDULES = PartTable(
    "learning-rate schedule", "grpo.lr_schedule", "fn(done = (t - W) / (T - W) in [0, 1]) -> factor of grpo.lr"
)
LR_SCHEDULES.add("constant", f"{_SCHEDULES}:constant_lr", "grpo.lr after the warm-up")
LR_SCHEDULES.add("linear", f"{_SCHEDULES}:linear_lr", "linear decay from grpo.lr after the warm-up to 0 at the end")
LR_SCHEDULES.add("cosine", f"{_SCHEDULES}:cosine_lr", "half a cosine from grpo.lr after the warm-up to 0 at the end")

TABLES = (ADVANTAGE_ESTIMATORS, POLICY_RATIOS, POLICY_LOSSES, LOSS_AGGREGATIONS, KL_ESTIMATORS, LR_SCHEDULES)

# Step-level credit (grpo.step_credit): per-step advantages of multi-turn episodes. "none", the default, is not a
# part: it is GRPO's one advantage per row, unchanged, so this table is checked by the config on its own.
NO_STEP_CREDIT = "none"
_STEPS = "rlfabric.algorithms.step_credit"
STEP_CREDITS = PartTable(
    "step credit",
    "grpo.step_credit",
    "fn(step_rows [S], group_ids [N], step_rewards [S], episode_rewards [N], state_keys [S], *, omega, gamma, "
    "scale_by_std) -> advantages [S]",
)
STEP_CREDITS.add("gigpo", f"{_STEPS}:gigpo_advantages", "episode advantage + omega * step advantage within states")
STEP_CREDITS.add("step_mix", f"{_STEPS}:step_mix_advantages", "episode advantage + omega * step return over the group")
# Step credits that group steps by env state, so they need the record's state_keys.
STATE_KEYED_STEP_CREDITS = frozenset({"gigpo"})


ALL_TABLES = (*TABLES, STEP_CREDITS)


def snapshot() -> bytes | None:
    """The parts added in this process beyond rlfabric's own, each with its function, for the actors that
    resolve them (``load_snapshot`` there); None when there are none. A function whose module is not on this
    machine's path travels by name, for an actor whose node has it; one whose module fails to load, or lacks it,
    is a ConfigError."""
    from rlfabric import shipping

    parts = [(table.field, part) for table in ALL_TABLES for part in table.parts()]
    added = [(field, part) for field, part in parts if not part.target.startswith("rlfabric.")]
    if not added:
        return None
    functions: dict[str, Any] = {}
    for field, part in added:
        if not shipping.module_exists(part.target.partition(":")[0]):
            continue  # importable only where the actors run, as an installed package may be
        try:  # an error inside the user's module, or a function it lacks: said now, not at the first update
            functions[f"{field}:{part.name}"] = _TABLES_BY_FIELD[field].resolve(part.name)
        except Exception as exc:  # noqa: BLE001 - whatever the user's module raised, on one line
            raise ConfigError(
                f"{field} = {part.name!r}: its function {part.target!r} does not load: {exc.__class__.__name__}: "
                f"{' '.join(str(exc).split())}"
            ) from None
    return shipping.dumps_with_user_code({**functions, _PARTS_KEY: added})


def load_snapshot(blob: bytes | None) -> None:
    """Add the parts a ``snapshot`` holds to this process's tables."""
    if not blob:
        return
    from rlfabric import shipping

    shipped = shipping.loads(blob)
    for field, part in shipped.pop(_PARTS_KEY):
        _TABLES_BY_FIELD[field].install(part, shipped.get(f"{field}:{part.name}"))


_TABLES_BY_FIELD = {table.field: table for table in ALL_TABLES}
_PARTS_KEY = "parts"  # beside "field:name" keys, which hold a colon


def check_step_credit(name: str) -> None:
    """Raise a one-line ConfigError naming ``grpo.step_credit`` and the valid names unless ``name`` is one."""
    if name != NO_STEP_CREDIT and name not in STEP_CREDITS.names():
        allowed = ", ".join((NO_STEP_CREDIT, *STEP_CREDITS.names()))
        raise ConfigError(f"{STEP_CREDITS.field} = {name!r} is not valid: must be one of {allowed}")
