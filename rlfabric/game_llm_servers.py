"""The generator actors that serve a game's language-model policies: one per llm policy, supervised by its driver.

A runner's llm player that finds its generator dead, raising or past its deadline fails the runner's sample with
``GeneratorsFailed``, naming the generator by slot and generation. The game driver hands that error here: the slot
gets a new generator once (a later report about the same generation is about an actor already replaced), the
policy's learner loads its current weights into it when the policy trains, and every runner calls it from then on.
A generator that fails ``MAX_CONSECUTIVE_FAILURES`` times in a row stops the run with one line naming its policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlfabric.actor_slots import ActorSlots
from rlfabric.multiagent.config import PolicySpec
from rlfabric.policies.game_llm import LLMServing
from rlfabric.policies.served import GeneratorsFailed

GENERATOR_OPTIONS = {"max_batch_size": 64, "device": "cpu"}


class LLMServers:
    def __init__(self, specs: dict[str, PolicySpec], names: list[str], run_dir: Path, seed: int) -> None:
        """One torch-engine generator (1 CPU) for each llm policy in ``names``; a "builtin" model is built into
        ``run_dir`` first (kept there, so a resumed run serves the same model)."""
        from rlfabric.models.hf import BUILTIN, build_small_model_dir

        self.names = list(names)
        self.seed = seed
        self.model_dirs: list[str] = []
        for i, name in enumerate(self.names):
            model_dir = specs[name].model
            if model_dir == BUILTIN:
                model_dir = str(run_dir / "llm_players" / name)
                if not (Path(model_dir) / "config.json").is_file():
                    build_small_model_dir(model_dir, seed=seed + i)
            self.model_dirs.append(model_dir)
        self.slots = ActorSlots("generator", self._start, len(self.names))

    def _start(self, slot: int, generation: int) -> Any:
        from rlfabric.actors.generator import Generator

        options = {**GENERATOR_OPTIONS, "seed": self.seed + slot}
        return Generator.options(num_cpus=1).remote("torch", self.model_dirs[slot], options, num_threads=1)

    def serving(self) -> dict[str, LLMServing]:
        """Each llm policy's current generator, as runners take it."""
        return {
            name: LLMServing(self.model_dirs[slot], slot, generation, handle)
            for name, (slot, generation, handle) in zip(self.names, self.slots.entries(), strict=True)
        }

    def replace_failed(self, error: BaseException) -> list[str]:
        """Replace each generator that a runner's ``error`` reports failed (once per generation); return the
        policies that got a new one. Errors of other kinds name no generator: []. Raises ``RunAbortedError`` for
        a generator past its limit of failures in a row."""
        cause = getattr(error, "cause", error)  # a RayTaskError carries the runner's exception as its cause
        if not isinstance(cause, GeneratorsFailed):
            return []
        replaced = []
        for slot, generation, reason in cause.failures:
            name = self.names[slot]
            if self.slots.replace(slot, generation, f"the generator of llm policy '{name}' failed: {reason}"):
                replaced.append(name)
        return replaced

    def succeeded(self, answered: list[tuple[int, int]]) -> None:
        """A runner's sample came back: the generators it called (``answered``: (slot, generation) pairs, from its
        meta's ``llm_generators``) answered, which ends their runs of failures. A sample played before a slot's
        replacement names the generation that is gone, and ends nothing."""
        for slot, generation in answered:
            self.slots.succeeded(slot, generation)

    def shutdown(self) -> None:
        self.slots.shutdown()
