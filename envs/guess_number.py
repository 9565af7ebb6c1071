"""GuessNumber: a text game that takes several turns. The agent guesses a secret number; the env answers
"higher" or "lower" until the guess is right or the turns run out. Binary search solves 1..``high`` in
ceil(log2(high + 1)) turns; without reading the replies, a guess is right one time in ``high``.

A text env (rlfabric.text_env): ``reset(task)`` with ``task = {"secret": int}`` and optionally ``"high"`` (the
range's top for this task; else the env's), ``step(text)`` reads the first integer in the text. Reward
components: ``correct`` 1 on the right guess (what ``eval_accuracy`` averages); ``invalid`` 1 for a reply with no
number (weight it negatively in ``rewards.weights``). Spec: ``rlfabric/GuessNumber-v0`` (an entry point) or
``rlfabric.envs.guess_number:GuessNumber``; tasks: ``data.train: task:guess_number`` (``rlfabric.tasks``);
``bisection_player`` plays it perfectly, for a supervised warm-up on its demonstrations.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rlfabric.rewards import RewardInput, pointwise, process_reward
from rlfabric.text_env import TextStep

_NUMBER = re.compile(r"-?\d+")
_RANGE = re.compile(r"1 to (\d+)")
_CARELESS = random.Random(0)  # the careless player's slips: seeded, so a run's demonstrations repeat


class GuessNumber:
    """See the module docstring."""

    def __init__(self, high: int = 16) -> None:
        if high < 2:
            raise ValueError(f"GuessNumber high = {high}: must be at least 2")
        self.high = high
        self.secret: int | None = None

    def reset(self, task: dict[str, Any]) -> str:
        secret, high = int(task["secret"]), int(task.get("high", self.high))
        if not 1 <= secret <= high:
            raise ValueError(f"GuessNumber task secret = {secret}: must lie in 1..{high}")
        self.secret = secret
        return f"Guess my number, 1 to {high}."

    def step(self, action: str) -> TextStep:
        if self.secret is None:
            raise RuntimeError("GuessNumber.step called before reset")
        found = _NUMBER.search(action)
        if found is None:
            return TextStep("Say a number.", {"invalid": 1.0})
        guess = int(found.group())
        if guess == self.secret:
            return TextStep("Right.", {"correct": 1.0}, terminated=True)
        return TextStep("higher" if guess < self.secret else "lower")


def bisection_player(task: dict[str, Any], messages: list[dict[str, str]]) -> str:
    """The scripted player (``sft.player: rlfabric.envs.guess_number:bisection_player``): the middle of the range
    the replies so far leave, read from the chat (the first message gives the range's top)."""
    top = _RANGE.search(messages[0]["content"] if messages else "")
    low, high = 1, int(top.group(1)) if top else int(task.get("high", 16))
    for said, heard in zip(messages[1::2], messages[2::2], strict=False):
        found = _NUMBER.search(said["content"])
        if found is not None:
            low, high = narrowed(low, high, int(found.group()), heard["content"])
    return str((low + high) // 2)


def narrowed(low: int, high: int, guess: int, heard: str) -> tuple[int, int]:
    """The range low..high left once ``guess`` got the reply ``heard``: "higher" lifts the bottom above the guess,
    "lower" drops the top below it; any other reply leaves it."""
    if heard == "higher":
        return max(low, guess + 1), high
    if heard == "lower":
        return low, min(high, guess - 1)
    return low, high


@pointwise
@process_reward
def consistent_guesses(inputs: list[RewardInput]) -> list[list[dict[str, float]]]:
    """A process reward on GuessNumber's episodes, beside the env (``rlfabric.episode_rewards``: a step per turn,
    step k > 0 being "\\n" + the reply to the guess before + "\\n" + the turn): per turn, ``inconsistent`` = 1 when
    the turn's guess lies outside the range the replies so far leave (1..top at first), a turn without a number
    included, else 0. Bisection scores 0 on every turn; a guess outside the range can never be right, so the score
    tells a careless turn from an unlucky one before the episode's outcome does. Weight it negatively: a bonus per
    consistent turn would pay for long episodes. Spec: ``rlfabric.envs.guess_number:consistent_guesses``."""
    scored = []
    for sample in inputs:
        top = _RANGE.search(sample.prompt)
        low, high = 1, int(top.group(1)) if top else int(sample.metadata.get("high", 16))
        guess: int | None = None
        turns = []
        for k, step in enumerate(sample.step_texts()):
            turn = step
            if k > 0:
                _, heard, turn = step.split("\n", 2)
                if guess is not None:
                    low, high = narrowed(low, high, guess, heard)
            found = _NUMBER.search(turn)
            guess = int(found.group()) if found else None
            turns.append({"inconsistent": float(guess is None or not low <= guess <= high)})
        scored.append(turns)
    return scored


def careless_player(task: dict[str, Any], messages: list[dict[str, str]]) -> str:
    """``bisection_player`` that guesses anywhere in 1..top on a third of its turns: demonstrations that teach the
    game's format and roughly its strategy, leaving GRPO the rest (as the arithmetic task's unreliable teacher)."""
    if _CARELESS.random() < 1 / 3:
        top = _RANGE.search(messages[0]["content"] if messages else "")
        return str(_CARELESS.randint(1, int(top.group(1)) if top else int(task.get("high", 16))))
    return bisection_player(task, messages)
