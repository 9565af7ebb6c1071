"""Process rewards: a completion cut into steps, each step's token span, and rewards that score each step.

**Steps** (``rewards.process.split``, ``step_starts``). The completion's text is cut at markers:

- ``newline``: a step ends after each line break (a run of line breaks stays with the step before it);
- ``blank_line``: a step ends after each blank line (a line break followed by lines of only spaces and tabs);
- ``tag:TEXT``: a step starts at each occurrence of TEXT (``tag:<step>``, ``tag:Step ``);
- ``end_tag:TEXT``: a step ends after each occurrence of TEXT (``end_tag:</step>``);
- ``none``: one step, the whole completion.

Markers stay in the text, so the steps tile the completion: ``"".join(steps) == completion``. An **empty step** (only
whitespace and tags) joins the step after it (the last one joins the step before), so no step is scored on nothing.

**Token spans** (``split_completion``). A step's span is the sampled tokens from the token where its first
character begins up to the next step's: a boundary inside a token (``"\\n\\nThe"`` holding the end of one step and the
start of the next) gives that token to the step that starts inside it, the later one; a token that decodes to no
text of its own yet (a special token, the first bytes of a multi-byte character) goes with the text it precedes (an
end-of-sequence token, with none after it, stays in the last step). A step left with no token (every character of
it inside one token, which the next step also starts in) joins the next step, texts and all. Character offsets
come from the tokenizer itself: tokens [0, j) cover the longest common prefix of decode(ids[:j]) and the text (a
token that ends inside a multi-byte character decodes to a replacement character, so it covers none of it yet),
found by bisection, a few decodes per boundary.

**Rewards.** ``process_reward_model`` is a process reward model served like the reward model: a Hugging Face
sequence-classification model scores each step's prefix, prompt + steps[0] + ... + steps[k] (all of a sample's
prefixes in one forward where that is exact, ``rlfabric.rewards.prefix_scores``); its heads are the components.
``arithmetic_steps`` is a function one: each step ``expression=value`` is checked by evaluating it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

from rlfabric.reward_config import parse_split
from rlfabric.rewards.builtin import evaluate_expression, parse_expression
from rlfabric.rewards.prefix_scores import in_chunks, score_step_prefixes
from rlfabric.rewards.registry import RewardInput, gives, pointwise, process_reward, register_reward
from rlfabric.rewards.reward_model import (
    check_reward_model_kwargs,
    ensemble_components,
    load_reward_model,
    model_paths,
    resolve_device,
)

_NEWLINES = re.compile(r"\n+")
_BLANK_LINES = re.compile(r"\n(?:[^\S\n]*\n)+")  # a line break, then one or more lines of only spaces and tabs


def _marker_cuts(text: str, kind: str, tag: str) -> list[int]:
    """Character offsets where a new step starts, one per marker, before empty steps are merged."""
    if kind == "newline":
        return [m.end() for m in _NEWLINES.finditer(text)]
    if kind == "blank_line":
        return [m.end() for m in _BLANK_LINES.finditer(text)]
    found, at = [], text.find(tag)
    while at >= 0:
        found.append(at if kind == "tag" else at + len(tag))
        at = text.find(tag, at + len(tag))
    return found


def step_starts(text: str, split: str) -> list[int]:
    """The character offsets, ascending and inside (0, len(text)), where steps 2, 3, ... of ``text`` start under
    ``split`` (module docstring); an empty step (only whitespace and tags) joins the step after it, the last one
    the step before it. [] : one step."""
    kind, tag = parse_split(split)
    if kind == "none":
        return []

    def empty(start: int, end: int) -> bool:
        chunk = text[start:end]
        return not (chunk.replace(tag, "") if tag else chunk).strip()

    kept = [0]
    for cut in sorted({c for c in _marker_cuts(text, kind, tag) if 0 < c < len(text)}):
        if not empty(kept[-1], cut):  # an empty step so far runs on into the next one
            kept.append(cut)
    if len(kept) > 1 and empty(kept[-1], len(text)):
        kept.pop()
    return kept[1:]


def common_prefix_length(a: str, b: str) -> int:
    """The number of leading characters ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def split_completion(
    token_ids: Sequence[int], text: str, decode: Callable[[Sequence[int]], str], split: str
) -> tuple[list[str], list[int]]:
    """(step texts, step token ends) of a completion: its sampled ``token_ids``, its decoded ``text`` and the
    tokenizer's ``decode`` (ids -> text, as the text was decoded). Step k covers tokens [ends[k-1], ends[k]) (from
    0) and ``"".join(texts) == text``; ``ends[-1] == len(token_ids)``. At least one step, even for an empty
    completion. The rules for boundaries inside tokens and empty steps: the module docstring."""
    n = len(token_ids)
    starts = step_starts(text, split)
    if not starts:
        return [text], [n]
    covered: dict[int, int] = {0: 0}  # j -> characters of ``text`` that tokens [0, j) decode to

    def chars(j: int) -> int:
        if j not in covered:
            covered[j] = common_prefix_length(decode(token_ids[:j]), text)
        return covered[j]

    def first_token(c: int) -> int:
        """The first token of a step that starts at character c: the token that holds c, or the first token
        after the text before c (one that decodes to nothing yet goes with the text it precedes)."""
        lo, hi = 0, n + 1  # the smallest j with chars(j) >= c; chars(j) is non-decreasing in j
        while lo < hi:
            mid = (lo + hi) // 2
            if chars(mid) >= c:
                hi = mid
            else:
                lo = mid + 1
        return lo if lo > n or chars(lo) == c else lo - 1  # chars(lo) > c: token lo - 1 holds c

    char_bounds, token_bounds = [0], [0]
    for c in starts:
        k = first_token(c)
        if token_bounds[-1] < k < n:  # else the step so far has no token of its own: it runs on into this one
            char_bounds.append(c)
            token_bounds.append(k)
    texts = [text[a:b] for a, b in zip(char_bounds, [*char_bounds[1:], len(text)], strict=True)]
    return texts, [*token_bounds[1:], n]


# -- process rewards ------------------------------------------------------------------------------------------


def check_process_reward_model_kwargs(
    path: str | Sequence[str] = "",
    heads: Sequence[str] | None = None,
    batch_size: int = 64,
    max_length: int | None = None,
    device: str = "cpu",
) -> None:
    """Checked on the driver before any actor starts: ``reward_model``'s checks, and a path is required."""
    if not model_paths(path) or not all(model_paths(path)):
        raise ValueError("path: give the folder of a sequence-classification process reward model (or a list)")
    check_reward_model_kwargs(path, heads, batch_size, max_length, device)


@pointwise
@process_reward
def process_reward_model(
    inputs: list[RewardInput],
    *,
    path: str | Sequence[str] = "",
    heads: Sequence[str] | None = None,
    batch_size: int = 64,
    max_length: int | None = None,
    device: str = "cpu",
) -> list[list[dict[str, float]]]:
    """A process reward model: for each sample and each step k, the model(s) at ``path`` score the step's prefix
    prompt + steps[0] + ... + steps[k]; components per step as ``reward_model``'s per completion (a head per
    output, named by ``id2label``; ``heads`` keeps some; several paths: an ensemble with ``<head>_min`` and
    ``<head>_disagreement``). A sample's prefixes are read off one forward over its whole text where that is
    exact (``rlfabric.rewards.prefix_scores``), its group's samples behind one copy of their prompt where that is
    cheaper; the rest are scored prefix by prefix."""
    steps = [sample.step_texts() for sample in inputs]
    prompts = [sample.prompt for sample in inputs]
    resolved = resolve_device(device)
    loaded = [load_reward_model(p, resolved) for p in model_paths(path)]
    names = loaded[0][2]
    scores = np.stack(
        [
            np.concatenate(score_step_prefixes(model, tok, prompts, steps, batch_size, max_length))
            for model, tok, _ in loaded
        ]
    )
    keep = [names.index(h) for h in heads] if heads else list(range(len(names)))
    flat = ensemble_components(scores[:, :, keep], [names[k] for k in keep])
    return in_chunks(flat, [len(s) for s in steps])


process_reward_model.check_kwargs = check_process_reward_model_kwargs  # type: ignore[attr-defined]


@pointwise
@process_reward
@gives("step_correct")
def arithmetic_steps(inputs: list[RewardInput]) -> list[list[dict[str, float]]]:
    """A function process reward: per step, ``step_correct`` = 1 when the step is ``expression=value`` (markers
    and surrounding whitespace aside; the expression of non-negative integers, + - * / and parentheses, the value
    an integer, possibly negative) and the expression's value is the value, else 0."""
    out = []
    for sample in inputs:
        out.append([{"step_correct": float(_right_equation(step))} for step in sample.step_texts()])
    return out


def _right_equation(step: str) -> bool:
    left, sep, right = step.strip().partition("=")
    tree = parse_expression(left.strip()) if sep else None
    if tree is None or not re.fullmatch(r"-?\d+", right.strip()):
        return False
    return evaluate_expression(tree) == int(right.strip())


for _name, _fn in {"process_reward_model": process_reward_model, "arithmetic_steps": arithmetic_steps}.items():
    register_reward(_name, _fn)
