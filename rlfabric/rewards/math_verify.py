"""Find the final answer in a math completion and compare it with the reference, numerically where possible.

Where the answer is looked for, in order:
  1. the last ``\\boxed{...}`` (nested braces allowed);
  2. after the last ``answer:`` / ``Answer:`` / ``####`` marker: the number right after it, else the rest of its line;
  3. the last number anywhere in the text.

Two answers match when both normalize to the same number (``0.5``, ``1/2``, ``\\frac{1}{2}``, ``$0.50$`` are all
1/2; ``1,234`` is 1234) or, when either is not a number, to the same text once whitespace and ``$`` are dropped.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Literal

AnswerForm = Literal["boxed", "marker", "number", "none"]

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_FRACTION = r"-?\d+\s*/\s*-?\d+"
_NUMBER_RE = re.compile(rf"(?<![\w.])(?:{_FRACTION}|{_NUMBER})")
_MARKER_RE = re.compile(r"####|\banswer\s*:", re.IGNORECASE)
_LEADING_VALUE_RE = re.compile(rf"\s*\$?\s*({_FRACTION}|{_NUMBER})(?![\w/])")


def _last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}``, braces balanced."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth = 0
        for i in range(start + len("\\boxed"), len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len("\\boxed{") : i]
        start = text.rfind("\\boxed{", 0, start)  # unclosed: try the one before it
    return None


def find_answer(text: str) -> tuple[str | None, AnswerForm]:
    """The final answer in ``text`` and how it was found (``"none"`` when there is no answer at all)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip(), "boxed"
    markers = list(_MARKER_RE.finditer(text))
    if markers:
        rest = text[markers[-1].end() :].split("\n", 1)[0]
        number = _LEADING_VALUE_RE.match(rest)
        value = number.group(1) if number else rest.strip().rstrip(".").strip()
        if value:
            return value, "marker"
    numbers = _NUMBER_RE.findall(text)
    if numbers:
        return numbers[-1], "number"
    return None, "none"


def extract_answer(text: str) -> str | None:
    """The final answer in ``text`` (see the module docstring for where it is looked for), or None."""
    return find_answer(text)[0]


_FRAC_RE = re.compile(r"(-?)\\frac\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}")
_SHORT_FRAC_RE = re.compile(r"(-?)\\frac(\d)(\d)")  # LaTeX shorthand: \frac12
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def normalize_answer(s: str) -> Fraction | str:
    """A number as an exact Fraction when ``s`` is one, else the text without whitespace, ``$`` or a final period."""
    text = re.sub(r"\s+", "", str(s)).replace("$", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    text = text.rstrip(".")
    if _THOUSANDS_RE.fullmatch(text):
        text = text.replace(",", "")
    for pattern in (_FRAC_RE, _SHORT_FRAC_RE):
        match = pattern.fullmatch(text)
        if match and int(match.group(3)) != 0:
            sign = -1 if match.group(1) else 1
            return sign * Fraction(int(match.group(2)), int(match.group(3)))
    if re.fullmatch(r"-?\d+/-?\d+", text):
        num, den = text.split("/")
        if int(den) != 0:
            return Fraction(int(num), int(den))
    if re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)", text):
        return Fraction(text)
    return text


def answers_match(pred: str | None, truth: str | int | float) -> bool:
    """True when ``pred`` and ``truth`` are the same number, or the same text after normalization."""
    if pred is None:
        return False
    a, b = normalize_answer(pred), normalize_answer(str(truth))
    if isinstance(a, Fraction) != isinstance(b, Fraction):
        return False
    return a == b
