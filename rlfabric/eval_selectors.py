"""``rlfabric eval``'s selectors: what picks the best of N completions, parsed from ``--selector`` and checked
before any actor starts (``rlfabric.evaluation`` runs them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from rlfabric import rewards
from rlfabric.algorithms.best_of_n import STEP_AGGREGATES
from rlfabric.config import ConfigError
from rlfabric.reward_config import parse_split
from rlfabric.reward_model_stage import REWARD_MODEL_DIR, RUN_MODEL_SPECS, run_reward_model_specs
from rlfabric.rewards import RewardResult, RewardSpec

TRAIN_SELECTOR = "train"  # the selector that is the config's training reward
VERIFIER = "verifier"  # the reward pool of rewards.functions (no selector takes its label)
SELECTOR_KEYS = ("name", "kwargs", "weights", "label", "aggregate", "split")


@dataclass(frozen=True)
class Selector:
    """What picks the best of N: a reward service (``spec``) whose components, weighted by ``weights`` (for a
    component not named, the weight its function declares, else 1, as in ``rewards.weights``), sum to the score;
    or (``spec`` None) the training reward.
    A process reward's weighted step scores become one score by ``aggregate`` (``step_aggregate``)."""

    label: str
    spec: RewardSpec | None = None
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    aggregate: str | None = None
    split: str | None = None  # a process reward's steps (``rewards.process.split``'s values); None: the config's

    def score_of(self, components: dict[str, float]) -> float:
        """sum_c w_c * components[c], w_c = ``weights``[c] (1 for a component not named)."""
        return sum(self.weights.get(c, 1.0) * v for c, v in components.items())

    def step_scores(self, result: RewardResult) -> list[float]:
        """Each step's weighted components (``score_of``), for a process reward's result."""
        return [self.score_of(step) for step in result.step_components or []]


def parse_selector(text: str, field: str = "--selector") -> Selector:
    """A selector from ``train``, a reward name, or YAML/JSON ``{name, kwargs, weights, label}``."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
    if isinstance(value, str) and value == TRAIN_SELECTOR:
        return Selector(TRAIN_SELECTOR)
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(SELECTOR_KEYS))
        if unknown:
            raise ConfigError(f"{field} {text!r}: unknown key(s) {', '.join(unknown)}; allowed: {SELECTOR_KEYS}")
        weights = value.get("weights") or {}
        if not isinstance(weights, dict) or not all(isinstance(w, (int, float)) for w in weights.values()):
            raise ConfigError(f"{field} {text!r}: weights must map component names to numbers")
        aggregate, split = value.get("aggregate"), value.get("split")
        if aggregate is not None and aggregate not in STEP_AGGREGATES:
            raise ConfigError(f"{field} {text!r}: aggregate must be one of {', '.join(STEP_AGGREGATES)}")
        if split is not None:
            try:
                parse_split(str(split))
            except ValueError as exc:
                raise ConfigError(f"{field} {text!r}: split: {exc}") from None
        spec = RewardSpec.parse({k: value[k] for k in ("name", "kwargs") if k in value}, field)
        label, weights = str(value.get("label") or spec.name), {str(k): float(w) for k, w in weights.items()}
        return Selector(label, spec, weights, aggregate, None if split is None else str(split))
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"{field} {text!r} is not valid: expected '{TRAIN_SELECTOR}', a reward name, or "
            "'{name: reward_model, kwargs: {path: DIR}, weights: {...}, label: ...}'"
        )
    return Selector(value, RewardSpec(value))


def resolve_selector(spec: RewardSpec, field: str, label: str) -> rewards.RewardFn:
    """The selector's reward function; a name that is not found and is its own label is named once ("--selector =
    'x' is not valid", not "--selector 'x' = 'x' is not valid")."""
    try:
        return rewards.resolve_reward(spec, field)
    except rewards.RewardNotFoundError as exc:
        if label != spec.name:
            raise
        raise rewards.RewardNotFoundError(str(exc).replace(f"{field} = ", "--selector = ", 1)) from None


def check_selectors(selectors: list[Selector], run_dir: Path | None, run_model_kind: str) -> list[Selector]:
    """Unique labels; with a run, a spec that means the run's own model (``reward_model`` without a path,
    ``judge`` without a model) pointed at its ``reward_model/``, which is a ``run_model_kind``
    (``reward_model.kind``: ``RUN_MODEL_SPECS`` says which spec serves it); every reward resolvable on this
    process and an outcome reward (one ConfigError naming the selector, before any actor starts)."""
    out: list[Selector] = []
    for i, sel in enumerate(selectors):
        taken = {VERIFIER, *(s.label for s in out)}
        label = sel.label if sel.label not in taken else f"{sel.label}#{i}"
        spec, field = sel.spec, f"--selector {sel.label!r}"
        if spec is not None and run_dir is not None and run_reward_model_specs([spec]):
            name, key = RUN_MODEL_SPECS[run_model_kind]
            if spec.name != name:
                own = next(k for n, k in RUN_MODEL_SPECS.values() if n == spec.name)
                raise ConfigError(
                    f"{field}: {spec.name!r} without its model means the run's own model, which is a "
                    f"{run_model_kind} (reward_model.kind), served by {{name: {name}}}: give it kwargs.{own}"
                )
            spec = RewardSpec(spec.name, {**spec.kwargs, key: str(run_dir / REWARD_MODEL_DIR)})
        fn = None if spec is None else resolve_selector(spec, field, sel.label)
        process = fn is not None and rewards.is_process_reward(fn)
        if (sel.aggregate is not None or sel.split is not None) and not process:
            raise ConfigError(f"{field}: aggregate and split apply to a process reward's steps, not an outcome reward")
        declared = None if fn is None else rewards.declared_components(fn)
        if declared is not None:
            rewards.check_names_given(sel.weights, declared, f"{field} weights", f"reward {spec.name!r}")
        # the components it leaves out weigh what the function declares (the verifiers' format: 0), as in training
        weights = sel.weights if fn is None else rewards.weights_with_defaults(sel.weights, {field: fn})
        # a process reward's steps rank by their weakest unless told otherwise
        out.append(Selector(label, spec, weights, (sel.aggregate or "min") if process else None, sel.split))
    return out
