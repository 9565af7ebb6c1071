"""GameLLMLearner: the learner of a language-model policy that trains in a game (``multi_agent.policies.<name>.train``).

Its data are the policy's moves as token rows (``rlfabric.multiagent.llm_turns``: each move's reward components
``return`` and ``invalid``); its update is the GRPO family's clipped policy-gradient loss over them
(``LLMLearnerCore.train_on``), with the iteration's moves as one group; its weights go to the generator actor that
serves the policy, which tags later moves with the new version. It answers the game driver as a PPO learner does
(``update_from_refs``, ``publish``, ``state``, ``load_state``, ``get_version``), so a game's driver runs neural and
language-model learners side by side.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ray

from rlfabric.actors.llm_learner import LLMLearnerCore
from rlfabric.allocator import retain_freed_memory
from rlfabric.grpo_config import GRPOConfig, SFTConfig
from rlfabric.models.weights import FlatWeights

LOAD_TIMEOUT_S = 60.0  # for the generator to load new weights: past it, it counts as hung
# what update_from_refs reports, from the learner's metrics (the driver adds "/<policy>" with several policies)
REPORTED = ("pg_loss", "entropy", "grad_norm", "clip_fraction", "logprob_gap", "trained_rows")


def game_llm_learner_options(lr: float, invalid_move_penalty: float, max_new_tokens: int) -> dict[str, Any]:
    """``LLMLearnerCore``'s GRPO options and batch spec for a policy trained on its game moves."""
    grpo = {**dataclasses.asdict(GRPOConfig(lr=lr)), "norm_length": max_new_tokens}
    batch_spec = {
        "reward_weights": {"return": 1.0, "invalid": -invalid_move_penalty},
        "advantage": "grpo",
        "scale_by_std": True,
        "overlong_filter": False,
    }
    return {"grpo": grpo, "batch_spec": batch_spec}


@ray.remote
class GameLLMLearner:
    def __init__(
        self,
        model_dir: str,
        generator: Any,
        *,
        lr: float,
        invalid_move_penalty: float,
        temperature: float,
        max_new_tokens: int,
        seed: int,
    ) -> None:
        """``generator``: the actor serving the policy, which ``publish`` loads the new weights into."""
        retain_freed_memory()
        options = game_llm_learner_options(lr, invalid_move_penalty, max_new_tokens)
        self.core = LLMLearnerCore(
            model_dir,
            options["grpo"],
            dataclasses.asdict(SFTConfig()),
            temperature=temperature,
            seed=seed,
            num_threads=1,
            batch_spec=options["batch_spec"],
        )
        self.generator = generator
        self.lr = lr
        self.loaded_version = 0  # the generator starts from the same model folder

    def update_from_refs(self, refs: list[ray.ObjectRef]) -> dict[str, float]:
        """One update on the moves of these fragments (the ones whose episodes ended). With none (every episode
        still being played) the weights stay, but the version advances all the same: the driver counts one version
        per iteration for every policy, and a neural policy beside this one has advanced."""
        records = [r for r in ray.get(refs) if r.num_rows]
        moves = float(sum(r.num_rows for r in records))
        if not records:
            self.core.version += 1
            return {"trained_moves": 0.0}
        metrics = self.core.train_on(records, None, self.lr)
        out = {k: float(metrics[k]) for k in REPORTED if k in metrics}
        return {**out, "trained_moves": moves}

    def publish(self) -> tuple[dict[str, int], int]:
        """Load the current weights into the generator (when they changed) and return ({"version": v}, v): the
        runners' llm players take the version from the first. A generator that died keeps the run going: the
        runners' calls report it, and the driver gives this learner a new one (``serve_with``)."""
        version = self.core.version
        if version != self.loaded_version:
            try:
                self._load_into_generator()
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # dead or hung: the runners' calls report it, and its replacement gets these weights
        return {"version": version}, version

    def serve_with(self, generator: Any) -> int:
        """A new generator for the policy (the driver replaced a dead or hung one): load the current weights into
        it, so its moves are the trained policy's; returns their version."""
        self.generator = generator
        self._load_into_generator()
        return self.core.version

    def _load_into_generator(self) -> None:
        weights: FlatWeights = self.core.flat_weights()
        loaded = self.generator.update_weights.remote([ray.put(weights)], self.core.version)
        ray.get(loaded, timeout=LOAD_TIMEOUT_S)
        self.loaded_version = self.core.version

    def state(self) -> dict[str, Any]:
        return {
            "model": self.core.state_dict_cpu(),
            "optimizer": self.core.optimizer.state_dict(),
            "version": self.core.version,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.core.model.load_state_dict(state["model"])
        self.core.optimizer.load_state_dict(state["optimizer"])
        self.core.version = int(state["version"])

    def save_model(self, path: str) -> str:
        """The policy's model in Hugging Face format (a later run's ``model:``)."""
        return self.core.save(path, with_optimizer=False)

    def get_version(self) -> int:
        return self.core.version

    def pid(self) -> int:
        return os.getpid()
