"""GuessNumber: a text game that takes several turns. The agent guesses a secret number; the env answers
"higher" or "lower" until the guess is right or the turns run out. Binary search solves 1..``high`` in
ceil(log2(high + 1)) turns; without reading the replies, a guess is right one time in ``high``.

A text env (rlfabric.text_env): ``reset(task)`` with ``task = {"secret": int}``, ``step(text)`` reads the first
integer in the text. Reward components: ``solved`` 1 on the right guess; ``invalid`` 1 for a reply with no number
(weight it negatively in ``rewards.weights``). Spec: ``rlfabric/GuessNumber-v0`` (an entry point) or
``rlfabric.envs.guess_number:GuessNumber``.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rlfabric.text_env import TextStep

_NUMBER = re.compile(r"-?\d+")


class GuessNumber:
    """See the module docstring."""

    def __init__(self, high: int = 16) -> None:
        if high < 2:
            raise ValueError(f"GuessNumber high = {high}: must be at least 2")
        self.high = high
        self.secret: int | None = None

    def reset(self, task: dict[str, Any]) -> str:
        secret = int(task["secret"])
        if not 1 <= secret <= self.high:
            raise ValueError(f"GuessNumber task secret = {secret}: must lie in 1..{self.high}")
        self.secret = secret
        return f"Guess my number, 1 to {self.high}."

    def step(self, action: str) -> TextStep:
        if self.secret is None:
            raise RuntimeError("GuessNumber.step called before reset")
        found = _NUMBER.search(action)
        if found is None:
            return TextStep("Say a number.", {"invalid": 1.0})
        guess = int(found.group())
        if guess == self.secret:
            return TextStep("Right.", {"solved": 1.0}, terminated=True)
        return TextStep("higher" if guess < self.secret else "lower")


def guess_number_tasks(n: int, high: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` tasks with secrets drawn uniformly from 1..``high``."""
    rng = random.Random(seed)
    return [{"secret": rng.randint(1, high)} for _ in range(n)]


def binary_search_guess(low: int, high: int) -> int:
    """The scripted player's next guess when the secret lies in low..high (the demonstrations an SFT warm-up
    can learn from)."""
    return (low + high) // 2
