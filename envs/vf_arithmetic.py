"""Arithmetic as a ``verifiers`` environment, written with the library's own API: a ``SingleTurnEnv`` over a
dataset of ``question`` / ``answer`` rows, scored by a ``Rubric`` of two functions.

``load_environment(num_train, num_eval, max_operand, seed)`` is the Environments Hub convention: the run loads it
by ``env.verifiers.id: rlfabric.envs.vf_arithmetic:load_environment`` in the environment's own actor (where
``verifiers`` is installed, ``env.verifiers.pip``). Questions are ``12+35=`` sums (``rlfabric.tasks``' arithmetic
rows); the held-out split (``eval_dataset``) has no question of the training split. Rubric: ``exact_sum`` (weight
1: the reply, stripped, is the sum) and ``digits_only`` (weight 0.1: the reply is a number at all).

``unreliable_teacher`` answers the environment's calls for the warm-up (``sft.player``): the row's answer, off by
one with probability 0.6, as the quickstart's teacher, so GRPO on the rubric has something to correct.
Example: ``examples/verifiers_env_grpo.yaml``. This module imports ``verifiers`` only inside
``load_environment``: the player runs in the driver, which does not have the library.
"""

from __future__ import annotations

import random
from typing import Any

from rlfabric.tasks import arithmetic_rows

TEACHER_ERROR = 0.6
_TEACHER = random.Random(0)  # the teacher's slips: seeded, so a run's demonstrations repeat


def _reply(completion: Any) -> str:
    """The text of the model's last message (the library hands completions as message lists)."""
    if isinstance(completion, str):
        return completion.strip()
    return str(completion[-1]["content"] or "").strip() if completion else ""


def exact_sum(completion: Any, answer: str, **kwargs: Any) -> float:
    """1 when the reply is the sum, else 0."""
    return float(_reply(completion) == str(answer))


def digits_only(completion: Any, **kwargs: Any) -> float:
    """1 when the reply is a number (digits, at most a leading minus), else 0."""
    text = _reply(completion)
    return float(text.lstrip("-").isdigit())


def load_environment(num_train: int = 2000, num_eval: int = 200, max_operand: int = 49, seed: int = 0) -> Any:
    """The environment: see the module docstring."""
    import verifiers as vf
    from datasets import Dataset

    rows = arithmetic_rows(4 * (num_train + num_eval), seed=seed, max_operand=max_operand, ops="+")
    distinct = list({r["prompt"]: r for r in rows}.values())
    train, held_out = distinct[:num_train], distinct[num_train : num_train + num_eval]
    if len(held_out) < num_eval:
        raise ValueError(f"max_operand = {max_operand}: too few distinct sums for {num_train} + {num_eval} rows")

    def dataset(part: list[dict[str, Any]]) -> Any:
        return Dataset.from_list([{"question": r["prompt"], "answer": r["answer"]} for r in part])

    rubric = vf.Rubric(funcs=[exact_sum, digits_only], weights=[1.0, 0.1])
    return vf.SingleTurnEnv(dataset=dataset(train), eval_dataset=dataset(held_out), rubric=rubric)


def unreliable_teacher(task: dict[str, Any], messages: list[dict[str, Any]]) -> str:
    """The warm-up's answer to the environment's question: the sum, off by one with probability 0.6."""
    answer = int(task["answer"])
    return str(answer + 1 if _TEACHER.random() < TEACHER_ERROR else answer)
