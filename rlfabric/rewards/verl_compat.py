"""verl's reward functions, used as they are.

verl (volcengine/verl) scores one completion at a time:

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict

where a dict has the reward under "score" and anything else is logged as extra info. ``resolve_reward`` finds such
a function by its first three parameters' names (this module's ``adapt_verl``, one of the registry's ``ADAPTERS``:
importing ``rlfabric.rewards`` installs it) and wraps it with ``verl_reward`` into rlfabric's group contract
(``fn(inputs, **kwargs) -> list[dict[str, float]]``), on the driver and on each reward actor alike (the registry
keeps the unwrapped function, so it is wrapped exactly once on each side). Per sample, ``verl_scores`` calls

    fn(data_source=metadata.get("data_source"), solution_str=completion,
       ground_truth=metadata["reward_model"]["ground_truth"] (or metadata["ground_truth"] without that column),
       extra_info=metadata.get("extra_info"), **spec kwargs)

and gives the components

    {"score": s}                         for a number s, or a dict's "score"
    {"score": s, "correct": acc}         when the dict also has a numeric "acc" (verl's accuracy key)

"score" is the training reward (weight 1); "correct" weighs 0 by default (``@default_weights``), so it is the
held-out accuracy and never adds to the reward. The dict's other keys are dropped: verl only logs them, and a
component rlfabric does not know of in advance would count with weight 1 (silently training on ``score + key``).
A result of any other kind, a missing ground truth, or an exception fails that sample alone (``Unscored``).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

from rlfabric.config_base import ConfigError, raised_by_user_code
from rlfabric.rewards.registry import ADAPTERS, RewardFn, RewardInput, RewardSpec, Unscored, default_weights, gives

# The parameters verl's reward manager fills in; a verl function is one whose first three are named so.
VERL_PARAMETERS = ("data_source", "solution_str", "ground_truth")
FILLED = (*VERL_PARAMETERS, "extra_info")
VERL_CONTRACT = (
    "verl's compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) returns a number or "
    "a dict with a numeric 'score'"
)


def is_verl_reward(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a verl reward: its first three parameters are data_source, solution_str, ground_truth."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    first = [p.name for p in params[:3] if p.kind in positional]
    return tuple(first) == VERL_PARAMETERS


def _takes_extra_info(fn: Callable[..., Any]) -> bool:
    params = inspect.signature(fn).parameters.values()
    return any(p.name == "extra_info" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def ground_truth(metadata: Mapping[str, Any]) -> Any:
    """The row's ground truth as verl reads it: ``reward_model.ground_truth`` (verl's parquet column, a struct),
    else a top-level ``ground_truth`` column; KeyError naming both places when the row has neither."""
    nested = metadata.get("reward_model")
    if isinstance(nested, Mapping) and "ground_truth" in nested:
        return nested["ground_truth"]
    if "ground_truth" in metadata:
        return metadata["ground_truth"]
    raise KeyError(
        "no ground truth: a verl reward reads metadata['reward_model']['ground_truth'] or metadata['ground_truth'], "
        f"and the row has neither (its columns: {', '.join(map(str, metadata)) or 'none'})"
    )


def _number(value: Any) -> float | None:
    """``value`` as a finite float (bools count: verl's "acc" often is one), else None."""
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value)
    return None


def verl_components(result: Any) -> dict[str, float] | Unscored:
    """rlfabric's components for one verl result (see the module docstring): a number s -> {"score": s}; a dict
    -> its "score", and its "acc" as "correct" when numeric; anything else -> ``Unscored`` saying verl's contract."""
    score = _number(result.get("score")) if isinstance(result, Mapping) else _number(result)
    if score is None:
        got = (
            f"a dict without a finite number under 'score' (keys: {', '.join(map(str, result)) or 'none'})"
            if isinstance(result, Mapping)
            else f"{result!r}"[:80]
        )
        return Unscored(f"the verl reward returned {got}; {VERL_CONTRACT}")
    components = {"score": score}
    accuracy = _number(result.get("acc")) if isinstance(result, Mapping) else None
    if accuracy is not None:
        components["correct"] = accuracy
    return components


def verl_scores(fn: Callable[..., Any], inputs: list[RewardInput], **kwargs: Any) -> list[dict[str, float] | Unscored]:
    """The verl reward ``fn`` on each sample of a group (the call and the components: the module docstring); a
    sample whose row has no ground truth, or whose call raises or returns something else, is ``Unscored``."""
    extra_info = _takes_extra_info(fn)
    out: list[dict[str, float] | Unscored] = []
    for sample in inputs:
        meta = sample.metadata
        try:
            truth = ground_truth(meta)
        except KeyError as exc:
            out.append(Unscored(str(exc.args[0])))
            continue
        filled = {"data_source": meta.get("data_source"), "solution_str": sample.completion, "ground_truth": truth}
        if extra_info:
            filled["extra_info"] = meta.get("extra_info")
        try:
            result = fn(**filled, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's function failed on this sample: it alone is unscored
            out.append(Unscored(raised_by_user_code(exc)))
            continue
        out.append(verl_components(result))
    return out


def verl_reward(fn: Callable[..., Any], kwargs: Mapping[str, Any], field: str, name: str) -> RewardFn:
    """The verl reward ``fn`` in rlfabric's contract, ``kwargs`` (the spec's) bound; ConfigError naming
    ``field`` (``rewards.functions[i].kwargs``) when they do not fit ``fn``'s signature or name a filled parameter."""
    taken = sorted(set(kwargs) & set(FILLED))
    signature = inspect.signature(fn)
    try:
        if taken:
            raise TypeError(f"{', '.join(taken)}: filled in from each row, not the config")
        signature.bind(*[None] * len(VERL_PARAMETERS), **kwargs)
    except TypeError as exc:
        bare = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
        others = [str(p) for p in bare if p.name not in FILLED]
        raise ConfigError(
            f"{field} = {dict(kwargs)!r}: verl reward {name!r} cannot take them ({exc}); its parameters besides "
            f"{', '.join(FILLED)}: {', '.join(others) or 'none'}"
        ) from None
    wrapped = functools.partial(verl_scores, fn, **kwargs)
    # What `rlfabric rewards list` shows: the group, then fn's own parameters (not those filled in per row)
    group = inspect.Parameter("inputs", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    own = [p for p in signature.parameters.values() if p.name not in FILLED]
    wrapped.__signature__ = inspect.Signature([group, *own])  # type: ignore[attr-defined]
    wrapped.check_row = ground_truth  # type: ignore[attr-defined]  # rows without one: said before Ray starts
    return gives("score", "correct")(default_weights(correct=0.0)(wrapped))


def adapt_verl(fn: Callable[..., Any], spec: RewardSpec, field: str) -> RewardFn | None:
    """``verl_reward`` of ``fn`` when it is a verl reward, else None (the registry's ``ADAPTERS`` contract)."""
    return verl_reward(fn, spec.kwargs, f"{field}.kwargs", spec.name) if is_verl_reward(fn) else None


ADAPTERS.append(adapt_verl)
