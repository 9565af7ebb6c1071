"""What an LLM judge is shown and what it must answer: rubric prompts and verdict parsing, for the judge service
(``rlfabric.judge``) and for training a judge on the same prompts (``rlfabric.judge_training``).

A rubric is a list of criteria (``answer``, ``format``, each optionally with a description) and a scale: a
criterion's score is an integer 0..scale, divided by the scale to make a component in [0, 1]. Three modes:

* pointwise: one completion per call. ``{prompt}{completion}`` then ``Judge <rubric>:``; the verdict is
  ``answer=1 format=0`` (every criterion, any order).
* pairwise: two completions, ``A)`` and ``B)``; the verdict names the better one per criterion: ``answer=A``
  (``A``, ``B`` or ``tie``). A completion's component is its win rate: (wins + ties / 2) / comparisons.
* listwise: the whole group in one call, candidates ``1)`` .. ``n)``; the verdict is one line per candidate:
  ``1) answer=1 format=0``.

Parsers return ``None`` for what they cannot read (a criterion missing, a score out of range, a candidate without
its line): the service retries those, then records the samples as failed. Names are letters and digits, so the
small character models (whose alphabet has no ``_``) can write them.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MODES = ("pointwise", "pairwise", "listwise")
CRITERION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_ASSIGNMENT = re.compile(r"([A-Za-z][A-Za-z0-9]*)\s*=\s*([A-Za-z0-9.]+)")
_CANDIDATE_LINE = re.compile(r"^\s*(\d+)\)\s*(.*)$")
WINNERS = ("A", "B", "tie")


@dataclass(frozen=True)
class Rubric:
    """The criteria a judge scores, their descriptions ("" for none) and the top of the integer scale."""

    criteria: tuple[str, ...]
    descriptions: tuple[str, ...]
    scale: int = 1

    def text(self) -> str:
        """How the prompt names the criteria: ``answer, format`` or ``answer (the sum is right), format``."""
        return ", ".join(f"{c} ({d})" if d else c for c, d in zip(self.criteria, self.descriptions, strict=True))


def make_rubric(criteria: Sequence[str] | Mapping[str, str], scale: int = 1) -> Rubric:
    """A rubric from a list of names or a {name: description} mapping; ValueError naming what is wrong."""
    items = list(criteria.items()) if isinstance(criteria, Mapping) else [(c, "") for c in criteria]
    if not items:
        raise ValueError("criteria is empty: name at least one criterion")
    for name, description in items:
        if not isinstance(name, str) or not CRITERION_NAME.fullmatch(name):
            raise ValueError(f"criterion {name!r} is not valid: letters and digits, starting with a letter")
        if not isinstance(description, str):
            raise ValueError(f"criterion {name!r}: its description must be a string, got {description!r}")
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ValueError(f"criteria {names}: names must be distinct")
    if not isinstance(scale, int) or isinstance(scale, bool) or not 1 <= scale <= 9:
        raise ValueError(f"scale = {scale!r}: must be an integer from 1 to 9 (scores are one digit)")
    return Rubric(tuple(names), tuple(d for _, d in items), scale)


def _ask(rubric: Rubric) -> str:
    return f"Judge {rubric.text()}:\n"


def pointwise_prompt(prompt: str, completion: str, rubric: Rubric) -> str:
    return f"{prompt}{completion}\n{_ask(rubric)}"


def pairwise_prompt(prompt: str, first: str, second: str, rubric: Rubric) -> str:
    return f"{prompt}\nA) {first}\nB) {second}\n{_ask(rubric)}"


def listwise_prompt(prompt: str, completions: Sequence[str], rubric: Rubric) -> str:
    candidates = "".join(f"{k}) {c}\n" for k, c in enumerate(completions, 1))
    return f"{prompt}\n{candidates}{_ask(rubric)}"


def pointwise_verdict(scores: Mapping[str, int], rubric: Rubric) -> str:
    """The verdict text for integer ``scores`` (what a trained judge learns to write)."""
    return " ".join(f"{c}={scores[c]}" for c in rubric.criteria)


def pairwise_verdict(winners: Mapping[str, str], rubric: Rubric) -> str:
    return " ".join(f"{c}={winners[c]}" for c in rubric.criteria)


def listwise_verdict(scores: Sequence[Mapping[str, int]], rubric: Rubric) -> str:
    return "\n".join(f"{k}) {pointwise_verdict(s, rubric)}" for k, s in enumerate(scores, 1))


def _assignments(text: str) -> dict[str, str]:
    """``name=value`` pairs of ``text``; the first value of a name counts."""
    out: dict[str, str] = {}
    for name, value in _ASSIGNMENT.findall(text):
        out.setdefault(name, value)
    return out


def parse_scores(text: str, rubric: Rubric) -> dict[str, float] | None:
    """{criterion: score / scale} from ``answer=1 format=0``; None unless every criterion has an integer score
    in 0..scale."""
    found = _assignments(text)
    out = {}
    for criterion in rubric.criteria:
        value = found.get(criterion, "")
        if not value.isdigit() or int(value) > rubric.scale:
            return None
        out[criterion] = int(value) / rubric.scale
    return out


def parse_pairwise(text: str, rubric: Rubric) -> dict[str, str] | None:
    """{criterion: "A" | "B" | "tie"}; None unless every criterion names one of them."""
    found = _assignments(text)
    if not all(found.get(c) in WINNERS for c in rubric.criteria):
        return None
    return {c: found[c] for c in rubric.criteria}


def parse_listwise(text: str, num_candidates: int, rubric: Rubric) -> list[dict[str, float] | None]:
    """Each candidate's scores from its ``k) ...`` line (the first line for k counts); None for a candidate
    whose line is missing or unreadable."""
    lines: dict[int, str] = {}
    for line in text.splitlines():
        match = _CANDIDATE_LINE.match(line)
        if match:
            lines.setdefault(int(match.group(1)), match.group(2))
    return [parse_scores(lines[k], rubric) if k in lines else None for k in range(1, num_candidates + 1)]


def comparison_pairs(num_candidates: int, opponents: int | None) -> list[tuple[int, int]]:
    """The pairs (i, j), i shown as A, that a group's pairwise judging compares: every unordered pair when
    ``opponents`` is None, else each candidate against its next ``opponents`` neighbours around the group (i
    against i+1, ..., i+opponents mod n), each unordered pair once. Who is shown first alternates, so no
    candidate is always A (judges favour a position)."""
    n = num_candidates
    if opponents is None or opponents >= n - 1:
        unordered = list(itertools.combinations(range(n), 2))
    else:
        seen: set[tuple[int, int]] = set()
        unordered = []
        for d in range(1, opponents + 1):
            for i in range(n):
                pair = (min(i, (i + d) % n), max(i, (i + d) % n))
                if pair[0] != pair[1] and pair not in seen:
                    seen.add(pair)
                    unordered.append(pair)
    return [(i, j) if k % 2 == 0 else (j, i) for k, (i, j) in enumerate(unordered)]


def win_rates(
    num_candidates: int,
    pairs: Sequence[tuple[int, int]],
    verdicts: Sequence[Mapping[str, str] | None],
    rubric: Rubric,
) -> list[dict[str, float] | None]:
    """Per candidate and criterion, ``(wins + ties / 2) / comparisons`` over the comparisons that got a verdict;
    None for a candidate none of whose comparisons did."""
    points = [dict.fromkeys(rubric.criteria, 0.0) for _ in range(num_candidates)]
    counted = [0] * num_candidates
    for (a, b), verdict in zip(pairs, verdicts, strict=True):
        if verdict is None:
            continue
        counted[a] += 1
        counted[b] += 1
        for criterion, winner in verdict.items():
            points[a][criterion] += {"A": 1.0, "B": 0.0, "tie": 0.5}[winner]
            points[b][criterion] += {"A": 0.0, "B": 1.0, "tie": 0.5}[winner]
    return [{c: p / counted[k] for c, p in points[k].items()} if counted[k] else None for k, p in enumerate(points)]
