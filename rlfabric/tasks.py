"""Verifiable single-turn text tasks that generate their own prompts from a seed (no downloads), by name.

A data spec ``task:<name>`` (``rlfabric.data``) names a generator in ``TASKS``. Each generator is
``rows(n, seed, **options) -> list[dict]``: ``n`` rows, the same for the same arguments. A row holds the prompt under
``"prompt"``, the reference ``"answer"``, and whatever else the task's reward needs; every key but the prompt
reaches the reward functions as per-sample metadata.

Prompts and answers use only characters of ``rlfabric.models.hf.DEFAULT_ALPHABET`` and stay short, because the
small CPU model reads them one character per token.

The tasks are data, so they live in the bottom layer beside ``rlfabric.data``, which reads them; envs build on them
(``rlfabric.envs.text_tasks`` re-exports them) and never the other way round.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from typing import Any

ARITHMETIC_OPS = "+-*/"
COUNTDOWN_OPS = "+-*"
TEACHER_SAMPLES = 5  # demonstrations per row from the unreliable arithmetic teacher


def _check_count(n: int, seed: int) -> None:
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n = {n!r}: must be an integer >= 0")
    if not isinstance(seed, int):
        raise ValueError(f"seed = {seed!r}: must be an integer")


def arithmetic_rows(
    n: int,
    seed: int,
    min_operand: int = 0,
    max_operand: int = 99,
    ops: str = "+-",
    teacher_error: float = 0.0,
) -> list[dict]:
    """Rows like ``{"prompt": "12+35=", "answer": "47"}``: one binary operation on two integer operands.

    ``ops`` picks the operators from ``+-*/``, uniformly per row. Operands are drawn uniformly from
    ``[min_operand, max_operand]``. Subtraction may give a negative answer (``"3-8="`` -> ``"-5"``). Division is
    exact: the prompt is ``"{a*b}/{b}="`` with ``b >= max(1, min_operand)`` and the answer ``a``.

    ``teacher_error`` > 0 adds a ``"teacher"`` column: five demonstrations from an unreliable teacher, each off by
    one (answer + 1) with that probability, for a supervised warm-up (which picks one per use) that the verifiable
    reward then corrects.
    """
    _check_count(n, seed)
    if not isinstance(min_operand, int) or not isinstance(max_operand, int) or not 0 <= min_operand <= max_operand:
        raise ValueError(
            f"min_operand = {min_operand!r}, max_operand = {max_operand!r}: need integers with 0 <= min <= max"
        )
    if not isinstance(ops, str) or not ops or set(ops) - set(ARITHMETIC_OPS):
        raise ValueError(f"ops = {ops!r}: must be a non-empty string of operators from {ARITHMETIC_OPS!r}")
    if not isinstance(teacher_error, (int, float)) or not 0 <= teacher_error <= 1:
        raise ValueError(f"teacher_error = {teacher_error!r}: must be a number in [0, 1]")
    if "/" in ops and max_operand < 1:
        raise ValueError(f"ops = {ops!r}: division needs max_operand >= 1 (a nonzero divisor), got {max_operand}")
    rng = random.Random(seed)
    operators = sorted(set(ops), key=ARITHMETIC_OPS.index)  # the same draws whatever order ops lists them in
    rows = []
    for _ in range(n):
        op = rng.choice(operators)
        a = rng.randint(min_operand, max_operand)
        b = rng.randint(max(min_operand, 1) if op == "/" else min_operand, max_operand)
        if op == "/":
            prompt, answer = f"{a * b}/{b}=", a
        else:
            answer = {"+": a + b, "-": a - b, "*": a * b}[op]
            prompt = f"{a}{op}{b}="
        rows.append({"prompt": prompt, "answer": str(answer)})
    if teacher_error > 0:  # its own stream, so the prompts do not depend on the error rate
        teacher_rng = random.Random(seed + 1)
        for row in rows:
            off_by = [int(teacher_rng.random() < teacher_error) for _ in range(TEACHER_SAMPLES)]
            row["teacher"] = [str(int(row["answer"]) + k) for k in off_by]
    return rows


def arithmetic_pairs(n: int, seed: int, max_operand: int = 49, ops: str = "+", length_share: float = 0.0) -> list[dict]:
    """Preference pairs on ``arithmetic`` prompts, for training a reward model (``reward_model.pairs``): rows
    ``{"prompt": "12+35=", "chosen": "47", "rejected": "44", "head": "answer", "answer": "47"}``.

    The rejected answer is, with equal odds, a near miss (the answer moved by 1 to 9 either way), a number drawn
    from [0, 2 * max_operand], or the answer edited: a digit repeated, dropped or added ("477", "4", "473"), so
    the model also learns to refuse the malformed strings a policy tries once it optimises against it (never the
    answer itself). With ``length_share`` > 0 that share of the rows are ``"head": "brevity"`` pairs
    instead: one completion x (the answer or a wrong one, even odds) against x written twice, so a brevity head
    learns that shorter is better whatever the answer.
    """
    if not isinstance(length_share, (int, float)) or not 0 <= length_share <= 1:
        raise ValueError(f"length_share = {length_share!r}: must be a number in [0, 1]")
    rows = arithmetic_rows(n, seed, max_operand=max_operand, ops=ops)
    rng = random.Random(seed + 2)  # its own stream: the prompts are arithmetic_rows' for the same seed
    for row in rows:
        answer = row["answer"]
        wrong = answer
        while wrong == answer:
            wrong = _wrong_answer(answer, rng, max_operand)
        if rng.random() < length_share:
            short = answer if rng.random() < 0.5 else wrong
            row.update(chosen=short, rejected=short + short, head="brevity")
        else:
            row.update(chosen=answer, rejected=wrong, head="answer")
    return rows


def _wrong_answer(answer: str, rng: random.Random, max_operand: int) -> str:
    """A near miss, a random number, or the answer with a digit repeated, dropped or added (may equal the
    answer: the caller draws again)."""
    kind = rng.randrange(3)
    if kind == 0:
        return str(int(answer) + rng.choice([-1, 1]) * rng.randint(1, 9))
    if kind == 1:
        return str(rng.randint(0, 2 * max_operand))
    at = rng.randrange(len(answer))
    edit = rng.randrange(3)
    if edit == 0:
        return answer[: at + 1] + answer[at] + answer[at + 1 :]
    if edit == 1 and len(answer) > 1:
        return answer[:at] + answer[at + 1 :]
    return answer[:at] + str(rng.randrange(10)) + answer[at:]


def _value_of(numbers: list[int], ops: list[str]) -> int:
    """Value of ``n0 op0 n1 op1 n2 ...`` with the usual precedence: a sum of signed products."""
    terms = [numbers[0]]
    for op, x in zip(ops, numbers[1:], strict=True):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x if op == "+" else -x)
    return sum(terms)


def countdown_rows(n: int, seed: int, num_numbers: int = 3, max_number: int = 20) -> list[dict]:
    """Countdown-style rows: reach a target from given numbers with + - * (each number at most once).

    Prompt format: the numbers separated by spaces, ``" -> "``, the target, ``":"``; e.g. ``"3 5 7 -> 22:"``.
    The row also holds ``numbers`` (list of int, in prompt order), ``target`` (int, always >= 1) and ``answer``:
    one expression that reaches the target using every number once (e.g. ``"3*5+7"``), so the target is
    reachable by construction. Numbers are drawn uniformly from ``[1, max_number]``.
    """
    _check_count(n, seed)
    if not isinstance(num_numbers, int) or num_numbers < 2:
        raise ValueError(f"num_numbers = {num_numbers!r}: must be an integer >= 2")
    if not isinstance(max_number, int) or max_number < 1:
        raise ValueError(f"max_number = {max_number!r}: must be an integer >= 1")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        order = rng.sample(numbers, k=num_numbers)  # the answer need not use them in prompt order
        for _attempt in range(10):  # redraw the operators until the target is positive
            ops = [rng.choice(COUNTDOWN_OPS) for _ in range(num_numbers - 1)]
            if _value_of(order, ops) >= 1:
                break
        else:
            ops = ["+"] * (num_numbers - 1)  # a sum of positive numbers is always positive
        target = _value_of(order, ops)
        answer = str(order[0]) + "".join(op + str(x) for op, x in zip(ops, order[1:], strict=True))
        prompt = " ".join(map(str, numbers)) + f" -> {target}:"
        rows.append({"prompt": prompt, "answer": answer, "numbers": numbers, "target": target})
    return rows


# Data specs name these as "task:<name>" (rlfabric.data reads this table); the reward of the same name scores them.
def guess_number_rows(n: int, seed: int, min_high: int = 8, max_high: int = 16) -> list[dict]:
    """Tasks of the GuessNumber text env (``rlfabric/GuessNumber-v0``): rows like ``{"prompt": "7 of 1..12",
    "secret": 7, "high": 12}``, the range's top uniform in ``[min_high, max_high]`` and the secret uniform in it.
    ``prompt`` names the task (held-out splits keep tasks apart by it); the env writes what the agent reads."""
    _check_count(n, seed)
    if not isinstance(min_high, int) or not isinstance(max_high, int) or not 2 <= min_high <= max_high:
        raise ValueError(f"min_high = {min_high!r}, max_high = {max_high!r}: need integers with 2 <= min <= max")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        high = rng.randint(min_high, max_high)
        secret = rng.randint(1, high)
        rows.append({"prompt": f"{secret} of 1..{high}", "secret": secret, "high": high})
    return rows


def key_lookup_rows(n: int, seed: int, table_size: int = 4, key_length: int = 2, value_length: int = 2) -> list[dict]:
    """Tasks of the KeyLookup tool-use env (``rlfabric/KeyLookup-v0``): rows like ``{"prompt": "xy of ab=qd
    xy=mt", "key": "xy", "table": {"ab": "qd", "xy": "mt"}}``: ``table_size`` distinct keys of ``key_length``
    lowercase letters, each with a value of ``value_length`` lowercase letters, and the key asked for one of them.
    ``prompt`` names the task (held-out splits keep tasks apart by it); the agent sees only the question."""
    _check_count(n, seed)
    for name, value in (("table_size", table_size), ("key_length", key_length), ("value_length", value_length)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} = {value!r}: must be an integer >= 1")
    if table_size > 26**key_length:
        raise ValueError(f"table_size = {table_size}: more than the {26**key_length} keys of {key_length} letters")
    rng = random.Random(seed)

    def word(length: int) -> str:
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(length))

    rows = []
    for _ in range(n):
        keys: list[str] = []
        while len(keys) < table_size:
            key = word(key_length)
            if key not in keys:
                keys.append(key)
        table = {k: word(value_length) for k in keys}
        key = rng.choice(keys)
        prompt = f"{key} of " + " ".join(f"{k}={v}" for k, v in table.items())
        rows.append({"prompt": prompt, "key": key, "table": table})
    return rows


# A generator that lives above this layer (it starts MCP servers to sample their live state) is named by its
# "package.module:function" path, imported only when a spec uses it.
TASKS: dict[str, Callable[..., list[dict[str, Any]]] | str] = {
    "arithmetic": arithmetic_rows,
    "arithmetic_pairs": arithmetic_pairs,
    "countdown": countdown_rows,
    "guess_number": guess_number_rows,
    "key_lookup": key_lookup_rows,
    "mcp": "rlfabric.envs.mcp_tasks:mcp_task_rows",
}
