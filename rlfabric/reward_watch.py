"""What the GRPO driver watches in the rewards of its steps: rewards that fail on every sample step after step (the
run stops rather than train on nothing), components the config names that resemble ones the rewards gave (a
misspelling, said at the first scored step), several components summed at a weight nobody gave them (said once),
and components it names that no reward gave (said at the end)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rlfabric.actor_slots import RunAbortedError
from rlfabric.grpo_config import LLMConfig, plays_episodes
from rlfabric.reward_names import misspelling_note, names_by_field, unknown_components

MAX_STEPS_WITHOUT_SCORES = 3  # steps in a row in which every sample failed its reward: the run stops


def failing_part(cfg: LLMConfig) -> str:
    """What fails a sample of this run, for the errors that stop it."""
    if not plays_episodes(cfg):
        return "its reward"
    return "its episode or its reward" if cfg.rewards.functions else "its episode"


class RewardWatch:
    """``references``: the components the reward config names, as the user wrote them (``component_references``);
    ``note`` prints one line to the run's console; ``weights``: the scalar reward's weights as the rollout workers
    use them (a component they leave out counts with weight 1)."""

    def __init__(
        self,
        cfg: LLMConfig,
        references: list[tuple[str, str]],
        note: Callable[[str], None],
        weights: Mapping[str, float] | None = None,
    ) -> None:
        self.cfg, self.references, self.note = cfg, references, note
        self.weights = dict(weights if weights is not None else cfg.rewards.scalar_weights())
        self.steps_without_scores = 0
        self.components_given: set[str] = set()
        self.unweighted_said = False

    def after_step(self, scored: list[dict[str, Any]], errors_seen: set[str]) -> None:
        """The step's scored rollouts' metadata, and the reward errors seen so far in the run."""
        self._check_scoring(scored, errors_seen)
        self._check_component_names(scored)

    def _check_scoring(self, scored: list[dict[str, Any]], errors_seen: set[str]) -> None:
        if any(m["rows"] for m in scored) or not errors_seen:
            self.steps_without_scores = 0
            return
        self.steps_without_scores += 1
        if self.steps_without_scores >= MAX_STEPS_WITHOUT_SCORES:
            first = next(iter(errors_seen))
            steps, part = MAX_STEPS_WITHOUT_SCORES, failing_part(self.cfg)
            raise RunAbortedError(f"every sample of the last {steps} steps failed {part}; first error: {first}")

    def _check_component_names(self, scored: list[dict[str, Any]]) -> None:
        given = {name for m in scored if m["rows"] for name in m["component_means"]}
        if given and not self.components_given:
            misspelt = misspelling_note(self.references, given)
            if misspelt:
                self.note(misspelt)
        self.components_given |= given
        self._check_unweighted()

    def _check_unweighted(self) -> None:
        """Once a run: two or more components that no weight names (config or a function's ``@default_weights``)
        are each summed at weight 1 into the reward trained on. A dict a reward gives for logging (an accuracy
        beside the score) then trains too, which a user coming from a library that trains on one score does not
        expect."""
        unweighted = sorted(self.components_given - set(self.weights))
        if len(unweighted) < 2 or self.unweighted_said:
            return
        self.unweighted_said = True
        names = ", ".join(repr(n) for n in unweighted)
        self.note(
            f"the reward trained on is the sum of {names}, each at weight 1 (rewards.weights names none of them); "
            "give a component that only describes a sample weight 0 in rewards.weights (e.g. "
            f"'rewards.weights={{{unweighted[0]}: 0}}') to log it without rewarding it"
        )

    def at_end(self) -> None:
        """A note naming each component the reward config names that no reward gave in this session."""
        unknown = unknown_components(self.references, self.components_given)
        if unknown and self.components_given:
            given = ", ".join(sorted(self.components_given))
            self.note(
                f"{names_by_field(unknown)}: no reward gave such a component in the steps this command ran (they "
                f"gave {given}): a penalty that never fired, or a wrong name"
            )
