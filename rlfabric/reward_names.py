"""The reward component names a config uses, against the components its rewards give.

A name is only a name: a component misspelt in ``rewards.weights`` weighs nothing (the component meant keeps its
default weight), a misspelt gate never passes (its gated component counts nowhere), a misspelt clip clips nothing,
a misspelt ``efficiency.success`` never marks a success. Pure functions: the driver prints what they return
(``rlfabric.llm_driver``); ``RewardsConfig.component_references`` lists the names, as (field, name) pairs.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection

from rlfabric.rewards.registry import check_names_given

# How close a name must be to a given component to be taken for its misspelling (difflib's ratio 2M / T).
MISSPELLING_RATIO = 0.8


def unknown_components(references: list[tuple[str, str]], given: set[str]) -> list[tuple[str, str]]:
    """The (field, name) pairs of ``references`` whose component is not in ``given`` (the components the
    rewards gave), each pair once, in order."""
    return list(dict.fromkeys((where, name) for where, name in references if name not in given))


def names_by_field(pairs: list[tuple[str, str]], label: Callable[[str], str] = repr) -> str:
    """``rewards.weights names 'a', 'b'; rewards.combine.clip names 'c'`` for (field, name) pairs; ``label``
    writes each name."""
    fields: dict[str, list[str]] = {}
    for where, name in pairs:
        fields.setdefault(where, []).append(label(name))
    return "; ".join(f"{where} names {', '.join(names)}" for where, names in fields.items())


def misspelling_note(references: list[tuple[str, str]], given: set[str]) -> str | None:
    """One line naming each unknown name (``unknown_components``) that resembles a given component (difflib's
    ratio at least ``MISSPELLING_RATIO``), with the component it resembles; None when none does."""
    resembles: dict[str, str] = {}
    found = []
    for where, name in unknown_components(references, given):
        close = difflib.get_close_matches(name, sorted(given), n=1, cutoff=MISSPELLING_RATIO)
        if close:
            resembles[name] = close[0]
            found.append((where, name))
    if not found:
        return None
    described = names_by_field(found, lambda name: f"{name!r} (did you mean {resembles[name]!r}?)")
    return described + ": no reward gave such a component at the first scored step"


def check_references_declared(references: list[tuple[str, str]], declared: Collection[str]) -> None:
    """ConfigError naming the first field of ``references`` with a name outside ``declared`` (every component the
    run's reward functions declare, when each declares its own: nothing else can give one), with the declared
    component it resembles: found before any actor starts, not as a note at the first scored step."""
    unknown = unknown_components(references, set(declared))
    if not unknown:
        return
    where, name = unknown[0]
    check_names_given([name], declared, where, "the run's reward set", "rlfabric rewards list shows what each gives")
