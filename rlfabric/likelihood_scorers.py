"""The likelihood scorer's lifecycle in a GRPO run: started when a policy ``likelihood`` reward asks for it,
replaced under the same name when it dies, hangs or fails a weight load, checked after a step that lost samples.

The scorer (``rlfabric.actors.likelihood_scorer``) is a Ray named actor: the reward services find it by the run's
own name for it (``SCORER_NAME_PREFIX`` + a random suffix), so a replacement under that name serves them at once.
The ``WeightPublisher`` delivers it every published version, as it does the generators.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import ray

from rlfabric.actor_slots import ActorSlots, RunAbortedError, error_summary
from rlfabric.grpo_config import LLMConfig
from rlfabric.llm_actors import policy_likelihood_specs, scorer_resources
from rlfabric.llm_resources import SETUP_TIMEOUT_S, torch_threads
from rlfabric.weight_publisher import WeightPublisher

SCORER_NAME_PREFIX = "rlfabric-likelihood-scorer-"  # + a run's own suffix: the Ray name of its scorer


def start_scorer(cfg: LLMConfig, model_dir: str, name: str) -> Any:
    """The likelihood scorer, the Ray actor named ``name``, holding ``model_dir`` (the policy's first weights)
    until the publisher sends it the current ones; a dead predecessor's name may take a moment to come free."""
    from rlfabric.actors.likelihood_scorer import LikelihoodScorer

    resources = scorer_resources(cfg)
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while True:
        try:
            return LikelihoodScorer.options(name=name, num_cpus=resources["CPU"], num_gpus=resources["GPU"]).remote(
                model_dir,
                dtype=cfg.model.dtype,
                device="cuda" if resources["GPU"] > 0 else "cpu",
                num_threads=torch_threads(cfg, "reference"),  # it computes when the reference would: between phases
            )
        except ray.exceptions.ActorAlreadyExistsError:
            if time.monotonic() > deadline:
                raise RunAbortedError(
                    f"the likelihood scorer could not start: the name {name!r} stayed taken for {SETUP_TIMEOUT_S:g}s"
                ) from None
            time.sleep(0.2)


class LikelihoodScorers:
    """The run's likelihood scorer slot (none when no policy likelihood reward asks for one) under its run-unique
    name; ``weights`` gives a replacement the published weights, ``note`` logs the replacement."""

    def __init__(self, cfg: LLMConfig, weights: WeightPublisher, note: Callable[[str], None]) -> None:
        self.cfg, self.weights, self.note = cfg, weights, note
        self.name = f"{SCORER_NAME_PREFIX}{uuid.uuid4().hex[:12]}"
        self.slots: ActorSlots | None = None  # set by ``start`` when the run needs a scorer

    def start(self, model_dir: str) -> ActorSlots | None:
        """Start the scorer, holding ``model_dir`` (the run's first model) until published weights reach it, when
        a policy likelihood reward asks for one; the slots to attach to the publisher (None: no scorer)."""
        if policy_likelihood_specs(self.cfg):
            self.slots = ActorSlots(
                "likelihood scorer", lambda slot, generation: start_scorer(self.cfg, model_dir, self.name), 1
            )
        return self.slots

    @property
    def handles(self) -> list[Any]:
        return self.slots.handles if self.slots is not None else []

    @property
    def reward_name(self) -> str | None:
        """The name the policy likelihood rewards call the scorer by (None: the run has none)."""
        return self.name if self.slots is not None else None

    def metrics(self) -> dict[str, int]:
        """For each step row: ``likelihood_scorer_restarts`` when the run has a scorer."""
        return {"likelihood_scorer_restarts": self.slots.restarts} if self.slots is not None else {}

    def replace(self, slot: int, generation: int, reason: str) -> int | None:
        """A scorer that died, hung or failed its load: a new one under the same name, given the current weights
        (only the groups scored while it was gone fail). The policy version published to it, or None when none
        was (already replaced, or nothing published yet: it holds the run's first model, version 0)."""
        assert self.slots is not None
        if not self.slots.replace(slot, generation, reason):
            return None  # already replaced: a late report about the actor that is gone
        self.note(f"likelihood scorer replaced ({reason})")
        # Weights published already (even by the publication whose load failed, not yet counted by the driver):
        # the new one gets them.
        if self.weights.published is None:
            return None
        self.weights.choose_transport()
        return self.weights.publish([], timeout=SETUP_TIMEOUT_S, scorer_slots=[slot])

    def unanswered(self) -> list[tuple[int, int, str]]:
        """After a step that lost samples: (slot, generation, reason) of each scorer that died or does not answer
        within the weight-load deadline, to replace now rather than at the next publication (a step that lost
        every group publishes nothing). One that answers ends its run of failures."""
        failed = []
        for slot, generation, scorer in self.slots.entries() if self.slots is not None else []:
            try:
                ray.get(scorer.version.remote(), timeout=self.cfg.generator.timeout_s)
                self.slots.succeeded(slot, generation)
            except ray.exceptions.GetTimeoutError:
                failed.append((slot, generation, "did not answer"))
            except ray.exceptions.RayError as exc:
                failed.append((slot, generation, error_summary(exc)))
        return failed

    def close(self) -> None:
        """Kill the scorer (a dead one already is); a closed run has no scorer slot."""
        for actor in self.handles:
            ray.kill(actor, no_restart=True)
        self.slots = None
