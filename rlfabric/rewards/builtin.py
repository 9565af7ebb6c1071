"""Built-in reward functions, registered under their names when ``rlfabric.rewards`` is imported.

Each scores a group and returns, per completion, named components in [0, 1] (``length`` in [-scale, 0]). The
verifiers' ``format`` weighs 0 unless ``rewards.weights`` names it (``@default_weights``): it is logged, not
rewarded.

* ``math``: ``correct`` (the extracted answer matches ``metadata["answer"]``; kwarg ``answer_key`` names another
  column), ``format`` (the answer was given in ``\\boxed{}`` or after an ``answer:`` / ``####`` marker, not just as
  the last number in the text).
* ``arithmetic``: for the ``task:arithmetic`` rows and the small character model: ``correct`` (the completion's
  first line, stripped, is exactly ``metadata["answer"]``; kwarg ``answer_key`` names another column), ``format``
  (that line is an integer literal).
* ``countdown``: for ``task:countdown`` rows: ``correct`` (the first line is an expression of the given numbers,
  each used at most once, that equals the target), ``format`` (that line is an expression of integers with
  ``+ - * /`` and parentheses). Expressions are parsed with ``ast`` and evaluated on exact fractions; nothing is
  ever ``eval``-ed.
* ``length``: ``length_penalty``, DAPO's soft overlong punishment (kwargs ``max_tokens``, ``cache_tokens``).
* ``reward_model``: a Hugging Face sequence-classification model's heads as components, or an ensemble's
  (``rlfabric.rewards.reward_model``; kwargs ``path``, ``heads``, ``batch_size``, ``max_length``, ``device``).
* ``likelihood``: the teacher-forced log-probability of a reference text after the prompt and the completion,
  under the current policy (synced each version) or a frozen model; ``teacher_logprob``: a teacher's mean
  log-prob of the completion (``rlfabric.rewards.likelihood``).
* ``judge``: an LLM judge on its own generator actors scores a rubric's criteria, pointwise, pairwise or listwise
  (``rlfabric.judge``; kwargs ``model``, ``mode``, ``criteria``, ``retries`` ...).
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, TypeVar

from rlfabric.rewards.likelihood import likelihood_reward, teacher_logprob_reward
from rlfabric.rewards.math_verify import answers_match, find_answer
from rlfabric.rewards.registry import (
    RewardInput,
    arguments_with_defaults,
    default_weights,
    gives,
    pointwise,
    register_reward,
)
from rlfabric.rewards.reward_model import reward_model_reward

F = TypeVar("F", bound=Callable[..., Any])


def reads_columns(*kwargs: str) -> Callable[[F], F]:
    """Mark the keyword arguments of a reward that name a column of the data rows it reads (``answer_key``): a
    run whose rows lack the column is refused before Ray starts (``columns_read``), not at every scored group."""

    def mark(fn: F) -> F:
        fn.reads_columns = kwargs  # type: ignore[attr-defined]
        return fn

    return mark


def columns_read(fn: Callable[..., Any]) -> dict[str, str]:
    """{kwarg: the column it names} for a reward marked with ``reads_columns``, its bound kwargs (a resolved spec,
    ``functools.partial``) over its defaults; {} for any other reward."""
    base = getattr(fn, "func", fn)
    names = getattr(base, "reads_columns", ())
    values = arguments_with_defaults(base, getattr(fn, "keywords", {})) if names else {}
    return {name: str(values[name]) for name in names}


def column_fix(kwarg: str, columns: Sequence[str]) -> str:
    """How to point a reward's ``kwarg`` at the column that holds what it reads, given the row's ``columns``."""
    if len(columns) == 1:
        return f"set its kwargs {kwarg}: {columns[0]}"
    if columns:
        return f"set its kwargs {kwarg} to the one that holds it ({', '.join(columns)})"
    return "the rows have no other column: add one that holds it"


def _meta(sample: RewardInput, key: str, reward: str, kwarg: str) -> Any:
    if key not in sample.metadata:
        has = sorted(sample.metadata)
        raise KeyError(
            f"reward {reward!r} needs metadata[{key!r}] (the column its kwargs {kwarg} names); this sample's "
            f"metadata has {has}: {column_fix(kwarg, has)}"
        )
    return sample.metadata[key]


def _first_line(text: str) -> str:
    return text.split("\n", 1)[0].strip()


@pointwise  # each sample on its own: one run per call across its groups
@default_weights(format=0.0)  # well formed is not correct: logged, not rewarded
@gives("correct", "format")
@reads_columns("answer_key")
def math_reward(inputs: list[RewardInput], *, answer_key: str = "answer") -> list[dict[str, float]]:
    out = []
    for sample in inputs:
        truth = _meta(sample, answer_key, "math", "answer_key")
        answer, form = find_answer(sample.completion)
        out.append({"correct": float(answers_match(answer, truth)), "format": float(form in ("boxed", "marker"))})
    return out


_INTEGER_RE = re.compile(r"-?\d+")


@pointwise  # each sample on its own: one run per call across its groups
@default_weights(format=0.0)  # well formed is not correct: logged, not rewarded
@gives("correct", "format")
@reads_columns("answer_key")
def arithmetic_reward(inputs: list[RewardInput], *, answer_key: str = "answer") -> list[dict[str, float]]:
    out = []
    for sample in inputs:
        line = _first_line(sample.completion)
        truth = str(_meta(sample, answer_key, "arithmetic", "answer_key")).strip()
        out.append({"correct": float(line == truth), "format": float(_INTEGER_RE.fullmatch(line) is not None)})
    return out


# Longer lines are not read as expressions: nothing the task needs is this long, and ast's recursion is bounded.
MAX_EXPRESSION_CHARS = 200
_EXPRESSION_CHARS_RE = re.compile(r"[\d\s+\-*/()]+")
_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def parse_expression(text: str) -> ast.expr | None:
    """The syntax tree of ``text`` if it is only non-negative integers, ``+ - * /`` and parentheses, else None.

    Only the listed characters pass the first check and only these node types the second, so a name, a call,
    an attribute or a unary minus never reaches the evaluator.
    """
    if len(text) > MAX_EXPRESSION_CHARS or not _EXPRESSION_CHARS_RE.fullmatch(text):
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, RecursionError, MemoryError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
            continue
        if isinstance(node, ast.Constant) and type(node.value) is int:
            continue
        if isinstance(node, ast.operator) and type(node) in _BINARY_OPS:
            continue
        return None
    return tree


def expression_numbers(tree: ast.expr) -> list[int]:
    """The integer literals of an expression, in order."""
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)]


def evaluate_expression(tree: ast.expr) -> Fraction | None:
    """The exact value of a tree from ``parse_expression``; None on division by zero."""
    if isinstance(tree, ast.Constant):
        return Fraction(tree.value)
    assert isinstance(tree, ast.BinOp)  # parse_expression lets nothing else through
    left, right = evaluate_expression(tree.left), evaluate_expression(tree.right)
    if left is None or right is None or (isinstance(tree.op, ast.Div) and right == 0):
        return None
    return _BINARY_OPS[type(tree.op)](left, right)


@pointwise  # each sample on its own: one run per call across its groups
@default_weights(format=0.0)  # well formed is not correct: logged, not rewarded
@gives("correct", "format")
@reads_columns("numbers_key", "target_key")
def countdown_reward(
    inputs: list[RewardInput], *, numbers_key: str = "numbers", target_key: str = "target"
) -> list[dict[str, float]]:
    out = []
    for sample in inputs:
        numbers = Counter(int(x) for x in _meta(sample, numbers_key, "countdown", "numbers_key"))
        target = Fraction(_meta(sample, target_key, "countdown", "target_key"))
        tree = parse_expression(_first_line(sample.completion))
        correct = False
        if tree is not None:
            used = Counter(expression_numbers(tree))
            correct = used <= numbers and evaluate_expression(tree) == target  # each number at most once
        out.append({"correct": float(correct), "format": float(tree is not None)})
    return out


@pointwise  # each sample on its own: one run per call across its groups
@gives("length_penalty")
def length_reward(
    inputs: list[RewardInput], *, max_tokens: int, cache_tokens: int, scale: float = 1.0
) -> list[dict[str, float]]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), for a completion of L = num_tokens tokens:

        length_penalty = 0                                              if L <= max_tokens - cache_tokens
                       = scale * ((max_tokens - cache_tokens) - L) / cache_tokens   if L <= max_tokens
                       = -scale                                         otherwise

    so the penalty grows linearly from 0 to -scale over the last ``cache_tokens`` tokens of the budget.
    """
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens = {max_tokens!r}: must be an integer >= 1")
    if not isinstance(cache_tokens, int) or not 1 <= cache_tokens <= max_tokens:
        raise ValueError(f"cache_tokens = {cache_tokens!r}: must be an integer in [1, max_tokens = {max_tokens}]")
    free = max_tokens - cache_tokens
    out = []
    for sample in inputs:
        length = sample.num_tokens
        if length <= free:
            penalty = 0.0
        elif length <= max_tokens:
            penalty = (free - length) / cache_tokens
        else:
            penalty = -1.0
        out.append({"length_penalty": scale * penalty})
    return out


BUILTIN_REWARDS = {
    "math": math_reward,
    "arithmetic": arithmetic_reward,
    "countdown": countdown_reward,
    "length": length_reward,
    "reward_model": reward_model_reward,
    "likelihood": likelihood_reward,
    "teacher_logprob": teacher_logprob_reward,
    "judge": "rlfabric.judge:judge_reward",  # calls its own generator actors: imported where it is first used
}

for _name, _fn in BUILTIN_REWARDS.items():
    register_reward(_name, _fn)
