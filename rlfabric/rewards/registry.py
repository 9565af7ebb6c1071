"""The reward contract and the reward registry: names and spec strings -> reward functions.

A reward function scores one GROUP (the n completions of one prompt) at a time, so listwise judges and
leave-one-out rewards fit the same contract as per-sample verifiers:

    fn(inputs: list[RewardInput], **kwargs) -> list[dict[str, float]]   # one dict of named components per input

A function may give ``Unscored(error)`` instead of a dict for a sample it could not score (a judge whose answer
would not parse after its retries): that sample alone is recorded as failed, the rest of its group is kept.

A function marked ``@process_reward`` scores the **steps** of each completion (``RewardInput.steps``: the step
texts, which tile the completion) and gives one dict per step instead of one per completion:

    fn(inputs: list[RewardInput], **kwargs) -> list[list[dict[str, float]]]   # per input, one dict per step

(or ``Unscored`` for a sample). Process rewards and outcome rewards run side by side: each completion's result has
its outcome components and its per-step components (``RewardResult.step_components``).

A function marked ``@default_weights(format=0.0)`` gives the weight of a component ``rewards.weights`` leaves out
(otherwise 1): a component that describes a sample rather than rewards it.

A function marked ``@gives("correct", "format")`` declares every component it gives: names a config takes from it
are then checked before any actor starts (two functions giving one component, ``rlfabric eval --correct``, a
selector's ``weights``), and the reward service fails a group whose result names a component not declared.

A function marked ``@pointwise`` scores each sample on its own (a reward model's forward pass): the reward service
hands it every sample of a call at once, across groups, so it can batch them. A function may carry
``check_kwargs(**kwargs)``, which ``resolve_reward`` calls on the driver, so a bad argument (a model path that
does not exist) is one ConfigError before any actor starts; and ``check_row(metadata)``, which the run calls on the
first row of each data file before Ray starts (raising ``KeyError`` or ``ValueError`` with one line when the rows
lack what it reads).

Specs, tried in this order: a name given to ``register_reward`` (or shipped with a registry snapshot), a name from
the ``rlfabric.rewards`` entry-point group of installed packages, then ``package.module:function``. A spec in the
config is a name or ``{"name": ..., "kwargs": {...}}``; ``resolve_reward`` binds the kwargs (checked against the
function's signature) with ``functools.partial``.

A verl reward, ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)``, is used as it
is: ``resolve_reward`` wraps it into this contract (``rlfabric.rewards.verl_compat``).

Reward actors get the driver's registrations through ``snapshot()``, exactly like env runners get envs.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import inspect
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfabric import shipping
from rlfabric.config import ConfigError
from rlfabric.config_base import raised_by_user_code


@dataclass
class RewardInput:
    """One completion to score."""

    prompt: str
    completion: str  # decoded text of the generated tokens (no special tokens)
    metadata: dict[str, Any]  # the dataset row minus the prompt (e.g. {"answer": "47"})
    finish_reason: str  # "stop" | "length"
    num_tokens: int
    # The completion's steps (rewards.process.split), whose concatenation is the completion; None: one step, the
    # whole completion (what process rewards then see). Outcome rewards may ignore it.
    steps: list[str] | None = None

    def step_texts(self) -> list[str]:
        """The steps a process reward scores: ``steps``, or the whole completion as one step."""
        return list(self.steps) if self.steps is not None else [self.completion]


@dataclass(frozen=True)
class Unscored:
    """A reward function's result for a sample it could not score: that sample is recorded as failed with
    ``error`` (one line), and only that sample."""

    error: str


RewardFn = Callable[[list[RewardInput]], list["dict[str, float] | Unscored"]]
# What a reward function is, said where one does not fit (a TRL-style function(completions, **kwargs) often).
CONTRACT = (
    "a reward is fn(inputs: list[RewardInput], **kwargs) -> list[dict[str, float]], the dataset's columns in "
    "inputs[i].metadata (see docs/migrating.md)"
)


@dataclass
class RewardResult:
    """The score of one completion: named components, or the error that kept it from being scored."""

    components: dict[str, float]  # empty when failed
    error: str | None = None  # one line: "ExcType: message" or "timed out after Xs" when scoring failed
    # Process rewards' components, one dict per step of the completion; None when no process reward ran (or the
    # sample failed).
    step_components: list[dict[str, float]] | None = None


@dataclass(frozen=True)
class RewardSpec:
    """One configured reward function: ``{"name": "length", "kwargs": {"max_tokens": 64, "cache_tokens": 16}}``."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | RewardSpec, field: str = "rewards.functions") -> RewardSpec:
        if isinstance(value, RewardSpec):
            return value
        if isinstance(value, str):
            return cls(value)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{field} = {value!r}: expected a reward name or {{name: ..., kwargs: {{...}}}}")
        unknown = sorted(set(value) - {"name", "kwargs"})
        if unknown:
            raise ConfigError(f"{field}: unknown key(s) {', '.join(unknown)}; a reward spec has 'name' and 'kwargs'")
        name, kwargs = value.get("name"), value.get("kwargs") or {}
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{field}.name = {name!r}: must be a reward name or 'package.module:function'")
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise ConfigError(f"{field}.kwargs = {kwargs!r}: must be a mapping of argument names to values")
        return cls(name, dict(kwargs))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kwargs": dict(self.kwargs)}


ENTRY_POINT_GROUP = "rlfabric.rewards"

# The attributes the decorators below set on a function (pointwise, process_reward, default_weights, gives)
MARKS = ("pointwise", "scores_steps", "default_reward_weights", "reward_components", "check_row")
_REGISTRY: dict[str, RewardFn | str] = {}  # a name -> its function, or the path to import it from
# Wrappers of other libraries' reward functions, tried in order by resolve_reward: adapt(fn, spec, field) gives fn
# in this contract with spec.kwargs bound, or None when fn is not theirs. rlfabric.rewards.verl_compat adds verl's.
ADAPTERS: list[Callable[[Callable[..., Any], RewardSpec, str], RewardFn | None]] = []


class RewardNotFoundError(ConfigError):
    """A reward spec that names nothing this process can import."""


def pointwise(fn: Callable[..., list[dict[str, float]]]) -> Callable[..., list[dict[str, float]]]:
    """Mark ``fn`` as scoring each sample independently of its group: the reward service may call it on the
    samples of many groups at once (one batch across groups) instead of once per group."""
    fn.pointwise = True  # type: ignore[attr-defined]
    return fn


def arguments_with_defaults(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` over the defaults of ``fn``'s keyword parameters (the group, its first parameter, left out): what
    a ``check_kwargs`` hook checks, without repeating the reward's signature."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return {**defaults, **kwargs}


def is_pointwise(fn: Callable[..., Any]) -> bool:
    return bool(getattr(fn, "pointwise", False))


def default_weights(**weights: float) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare the weights of ``fn``'s components that ``rewards.weights`` does not name, as
    ``@default_weights(format=0.0)``: for a component that describes a sample rather than rewards it (the built-in
    verifiers' ``format``: was the answer well formed), which would otherwise count with weight 1. A weight the
    config gives wins; components declared nowhere keep weight 1."""
    for name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise TypeError(f"default_weights({name}={weight!r}): a weight must be a finite number")

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.default_reward_weights = {name: float(w) for name, w in weights.items()}  # type: ignore[attr-defined]
        return fn

    return mark


def gives(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare every component ``fn`` gives (per sample, or per step for a process reward), as
    ``@gives("correct", "format")``. Undeclared functions may give any names, found only once they score."""
    if not names or not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"gives{names!r}: name one or more components, each a non-empty string")

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.reward_components = frozenset(names)  # type: ignore[attr-defined]
        return fn

    return mark


def declared_components(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The components ``fn`` declares with ``@gives``; None when it declares none."""
    return getattr(fn, "reward_components", None)


def components_of(functions: Mapping[str, Callable[..., Any]]) -> dict[str, str] | None:
    """{component: the config field of the function that declares it} for ``functions`` ({field: function});
    None when any of them declares nothing (its names are unknown until it scores). ConfigError when two
    functions declare one component: the reward service would fail every group (a name belongs to one function)."""
    owners: dict[str, str] = {}
    complete = True
    for where, fn in functions.items():
        names = declared_components(fn)
        if names is None:
            complete = False
            continue
        for name in sorted(names):
            first = owners.setdefault(name, where)
            if first != where:
                raise ConfigError(
                    f"{first} and {where} both give component {name!r}: a component comes from one function (wrap "
                    "one of them to rename it)"
                )
    return owners if complete else None


def check_names_given(
    names: Iterable[str], given: Collection[str], field: str, source: str, where_to_look: str = ""
) -> None:
    """ConfigError naming ``field`` when one of ``names`` is not in ``given`` (the components ``source``
    declares), with the given component it resembles and, when given, ``where_to_look`` for the names."""
    unknown = [name for name in names if name not in given]
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], sorted(given), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        f"{field} names {', '.join(map(repr, unknown))}{hint}: {source} gives only {', '.join(sorted(given))}"
        + (f" ({where_to_look})" if where_to_look else "")
    )


def declared_weights(fn: Callable[..., Any]) -> dict[str, float]:
    """The component weights ``fn`` declares with ``@default_weights`` ({} if none)."""
    return dict(getattr(fn, "default_reward_weights", None) or {})


def weights_with_defaults(
    weights: Mapping[str, float], functions: Mapping[str, Callable[..., Any]], field: str = "rewards.weights"
) -> dict[str, float]:
    """``weights`` (the config's ``rewards.weights``) and, for each component they leave out, the weight that one
    of ``functions`` ({config field: function}) declares with ``@default_weights``. Two functions that declare
    different weights for a component ``weights`` leaves out: ConfigError, since neither can be preferred."""
    merged = dict(weights)
    declared_by: dict[str, tuple[str, float]] = {}
    for where, fn in functions.items():
        for name, weight in declared_weights(fn).items():
            if name in weights:
                continue
            first = declared_by.setdefault(name, (where, weight))
            if first[1] != weight:
                raise ConfigError(
                    f"{first[0]} weighs component {name!r} {first[1]:g} by default and {where} weighs it "
                    f"{weight:g}: give {field}.{name} the weight it should have"
                )
            merged[name] = weight
    return merged


def process_reward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as a process reward: it reads each input's ``steps`` and returns, per input, a list of one
    component dict per step (or ``Unscored``). It may also be ``@pointwise``."""
    fn.scores_steps = True  # type: ignore[attr-defined]
    return fn


def is_process_reward(fn: Callable[..., Any]) -> bool:
    return bool(getattr(fn, "scores_steps", False))


def register_reward(name: str, fn: Callable[..., list[dict[str, float]]] | str) -> None:
    """Register ``fn(inputs, **kwargs) -> list[dict[str, float]]`` under ``name`` for the driver and reward actors.

    ``fn`` may be a ``"package.module:function"`` path instead, imported when the name is first resolved: a
    reward that calls actors (an LLM judge on its generators) lives above this package and registers so."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"register_reward: name {name!r} is not valid: a non-empty string without ':'")
    if not callable(fn) and not (isinstance(fn, str) and ":" in fn):
        raise TypeError(f"register_reward({name!r}, ...): fn must be callable or 'package.module:function', got {fn!r}")
    _REGISTRY[name] = fn


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _lookup(name: str, field: str) -> Callable[..., Any]:
    registered = _REGISTRY.get(name)
    if isinstance(registered, str):  # registered by path: imported now
        fn = shipping.import_callable(registered)
        if fn is None:
            raise RewardNotFoundError(f"{field} = {name!r}: its function {registered!r} cannot be imported")
        return fn
    if registered is not None:
        return registered
    eps = _entry_points()
    if name in eps:
        return eps[name].load()
    try:
        fn = shipping.import_callable(name)
    except Exception as exc:  # noqa: BLE001 - the module's own code raised while it was imported
        raise ConfigError(
            f"{field} = {name!r}: importing {name.partition(':')[0]!r} raised {raised_by_user_code(exc)}"
        ) from None
    if fn is not None:
        # Registered under its spec, so the registry snapshot carries it to the reward actors, by value when its
        # module is not installed (a module in the current directory): they resolve the spec by this name.
        _REGISTRY.setdefault(name, fn)
        return fn
    known = sorted(n for n in _REGISTRY if ":" not in n) + sorted(eps)  # not the specs resolved by path
    if ":" in name:
        raise RewardNotFoundError(f"{field} = {name!r} is not valid: {shipping.why_not_importable(name)}")
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise RewardNotFoundError(
        f"{field} = {name!r} is not valid{hint}: not a registered reward ({', '.join(known) or 'none registered'}) "
        "and not an importable 'package.module:function'"
    )


def _bind(fn: Callable[..., Any], spec: RewardSpec, field: str) -> RewardFn:
    """``fn`` with the spec's kwargs bound, after checking them against its signature."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none: the first call will tell
        signature = None
    if signature is not None:
        try:
            signature.bind([], **spec.kwargs)  # the group goes first; kwargs must fill the rest
        except TypeError as exc:
            params = list(signature.parameters)[1:]
            raise ConfigError(
                f"{field}.kwargs = {spec.kwargs!r}: reward {spec.name!r} cannot take them ({exc}); "
                f"its parameters: {', '.join(params) or 'none'}; {CONTRACT}"
            ) from exc
    check = getattr(fn, "check_kwargs", None)
    if check is not None:
        try:
            check(**spec.kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{field}.kwargs: reward {spec.name!r}: {exc}") from exc
    if not spec.kwargs:
        return fn
    bound = functools.partial(fn, **spec.kwargs)
    for mark in MARKS:  # what the decorators above declared about fn holds for it with its kwargs bound
        if hasattr(fn, mark):
            setattr(bound, mark, getattr(fn, mark))
    return bound


def resolve_rewards(specs: Sequence[str | Mapping[str, Any] | RewardSpec], field: str) -> dict[str, RewardFn]:
    """{``field[i]``: the function ``specs[i]`` names} (``resolve_reward`` of each)."""
    return {f"{field}[{i}]": resolve_reward(spec, f"{field}[{i}]") for i, spec in enumerate(specs)}


def resolve_reward(spec: str | Mapping[str, Any] | RewardSpec, field: str = "rewards.functions") -> RewardFn:
    """The reward function ``spec`` names, with its kwargs bound; ConfigError naming ``field`` if there is none."""
    parsed = RewardSpec.parse(spec, field)
    return _adapted(_lookup(parsed.name, field), parsed, field)


def _adapted(fn: Callable[..., Any], spec: RewardSpec, field: str) -> RewardFn:
    """``fn`` with the spec's kwargs bound, by the first of ``ADAPTERS`` that takes it (another library's reward,
    wrapped into this contract), else by ``_bind``. The registry keeps ``fn`` as it is, so the driver and each
    reward actor wrap it once each."""
    adapted = _adapt(fn, spec, field)
    return adapted if adapted is not None else _bind(fn, spec, field)


def _adapt(fn: Callable[..., Any], spec: RewardSpec, field: str) -> RewardFn | None:
    """``fn`` wrapped by the first of ``ADAPTERS`` that takes it; None when none does (an rlfabric reward)."""
    return next((a for a in (adapt(fn, spec, field) for adapt in ADAPTERS) if a is not None), None)


def describe_reward(name: str) -> str:
    """What ``name``'s function gives and takes, on one line, for ``rlfabric rewards list``: its declared
    components (``@gives``) with the weights it declares (``@default_weights``), its keyword arguments, and
    whether it is a process reward or pointwise."""
    fn = _lookup(name, "rlfabric rewards list")
    # another library's function is described as it runs here (a verl one: the components its wrapper gives)
    fn = _adapt(fn, RewardSpec(name), "rlfabric rewards list") or fn
    components = declared_components(fn)
    weights = declared_weights(fn)
    gives_text = (
        "gives " + ", ".join(f"{c} (weighs {weights[c]:g})" if c in weights else c for c in sorted(components))
        if components is not None
        else "components not declared (named once it scores)"
    )
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError):
        params = []
    kwargs = ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}" for p in params)
    kinds = [
        kind for kind, marked in (("process reward", is_process_reward(fn)), ("pointwise", is_pointwise(fn))) if marked
    ]
    return "; ".join([gives_text, f"kwargs: {kwargs or 'none'}", *kinds])


def list_rewards() -> dict[str, str]:
    """Name -> where it comes from (not the ``module:function`` specs kept for the reward actors)."""
    return shipping.describe_sources({n: f for n, f in _REGISTRY.items() if ":" not in n}, _entry_points())


def snapshot() -> bytes:
    """Serialize this process's registrations; modules that are not installed travel by value."""
    return shipping.dumps_with_user_code(_REGISTRY)


def load_snapshot(blob: bytes) -> None:
    """Install registrations shipped from the driver (in a reward actor)."""
    _REGISTRY.update(shipping.loads(blob))
