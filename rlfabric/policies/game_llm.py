"""A language model playing an agent of a game: its observation rendered as text, a completion from the generator
actors (``ServedLLMPolicy``), the reply parsed to a move.

The move is the first number in the reply. A reply without one, or naming a move the action mask forbids, becomes a
uniformly random legal move and is counted (``invalid``), so an illegal move never reaches the env and a weak model
costs only the quality of its play. Each move's ``LLMTurn`` (the prompt and reply tokens, their logprobs and
version, whether the reply was invalid) is kept in ``last_turns`` for the runner, which records them for the
policy's learner when it trains (``rlfabric.multiagent.llm_turns``); its version follows the weights the learner
loads into the generator.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from rlfabric.multiagent.llm_turns import LLMTurn
from rlfabric.policies.served import ServedLLMPolicy

NUMBER = re.compile(r"\d+")


class LLMServing(NamedTuple):
    """Where an llm policy is served: its model folder and the generator actor, with the actor's slot and
    generation in the driver's pool (a failed call names them, so the driver replaces that actor once)."""

    model_dir: str
    slot: int
    generation: int
    handle: Any

    @property
    def generator(self) -> tuple[int, int, Any]:
        """As ``ServedLLMPolicy`` takes it."""
        return self.slot, self.generation, self.handle


def parse_move(text: str, num_actions: int, mask: np.ndarray | None) -> int | None:
    """The first number in ``text`` when it is a legal action (below ``num_actions`` and allowed by ``mask``),
    else None."""
    found = NUMBER.search(text)
    if found is None:
        return None
    move = int(found.group())
    if move >= num_actions or (mask is not None and not mask[move]):
        return None
    return move


class LLMPlayer:
    """Acts like the runner's other policies: ``act(observations, masks) -> (actions, logprobs)``."""

    def __init__(
        self,
        served: ServedLLMPolicy,
        model_dir: str,
        render: Callable[[np.ndarray, np.ndarray | None], str],
        num_actions: int,
        seed: int,
    ) -> None:
        from rlfabric.models.hf import load_tokenizer  # torch: loaded only where a language model plays

        self.served = served
        self.tokenizer = load_tokenizer(model_dir)
        self.render = render
        self.num_actions = num_actions
        self.rng = np.random.default_rng(seed)
        self.version = 0
        self.moves = 0
        self.invalid = 0
        self.answered: set[tuple[int, int]] = set()  # (slot, generation) of each generator that answered
        self.last_turns: list[LLMTurn] = []

    def serve_from(self, serving: LLMServing) -> None:
        """Call a new generator from now on (the driver replaced a dead or hung one)."""
        self.served.generators = [serving.generator]

    def set_weights(self, published: dict[str, Any]) -> None:
        """The version its learner loaded into the generator (``GameLLMLearner.publish``)."""
        self.version = int(published["version"])

    def act(self, observations: np.ndarray, masks: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        n = len(observations)
        row_masks: list[Any] = [None] * n if masks is None else list(masks)
        prompts = [self.tokenizer.encode(self.render(o, m)) for o, m in zip(observations, row_masks, strict=True)]
        acted = self.served.act(prompts)
        self.answered.update((slot, generation) for slot, generation, _ in self.served.generators)
        actions = np.empty(n, np.int64)
        self.last_turns = []
        for i, (text, mask) in enumerate(zip(acted.info["text"], row_masks, strict=True)):
            move = parse_move(text, self.num_actions, mask)
            invalid = move is None
            if move is None:
                self.invalid += 1
                legal = np.flatnonzero(mask) if mask is not None else np.arange(self.num_actions)
                move = int(self.rng.choice(legal))
            actions[i] = move
            turn = LLMTurn(prompts[i], list(acted.actions[i]), list(acted.logprobs[i]), acted.versions[i], invalid)
            self.last_turns.append(turn)
        self.moves += n
        return actions, np.zeros(n, np.float32)
