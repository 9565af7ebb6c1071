"""Where a PPO run's actors go: what each runner and learner asks Ray for, and the reservations that hold them
(one placement group under ``ray.placement_strategy``, a group per role under ``ray.placement``).

``ActorPlacement`` is the PPO drivers' share of setup (``rlfabric.driver.Trainer`` and the game driver built on
it); it reads the driver's ``cfg``, ``placement_group``, ``role_groups`` and ``_num_learners``.
"""

from __future__ import annotations

from typing import Any

import ray

from rlfabric.config import Config, ConfigError
from rlfabric.placement import ActorRequest, RoleGroups

# How long setup waits for an actor to start before blaming the cluster's resources.
SETUP_TIMEOUT_S = 120.0


class ActorPlacement:
    cfg: Config
    placement_group: Any
    role_groups: RoleGroups | None

    def _num_learners(self) -> int:
        """Learner actors that take ``learner``'s resources (a game has one per trainable neural policy)."""
        return 1

    def _actor_options(
        self, num_cpus: float, num_gpus: float, resources: dict[str, float], role: str, index: int
    ) -> dict[str, Any]:
        """Ray options for the ``index``-th actor of ``role`` ("learner" or "runners"); with a placement group, it
        goes in its own reservation (the learners' bundles first, then one per runner), so a runner can never take
        a learner's GPU bundle."""
        opts: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "resources": resources or None}
        if self.placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundle = index if role == "learner" else self._num_learners() + index
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=bundle
            )
        elif self.role_groups is not None:
            opts.update(self.role_groups.options(role, index))
        return opts

    def _cpus_wanted(self) -> float:
        """CPUs the run's actors take: what a local Ray instance must have at least."""
        r = self.cfg.runners
        return r.num_runners * r.num_cpus + self._num_learners() * self.cfg.learner.num_cpus

    def _runner_resources(self) -> dict[str, float]:
        """What one runner asks Ray for: its bundle, and what a replacement needs a node to have."""
        return {"CPU": self.cfg.runners.num_cpus, **self.cfg.runners.resources}

    def _actor_requests(self) -> list[ActorRequest]:
        """The runners and learners the run starts, each with what it asks Ray for."""
        r, lc = self.cfg.runners, self.cfg.learner
        learner_bundle = {"CPU": lc.num_cpus, **({"GPU": lc.num_gpus} if lc.num_gpus else {}), **lc.resources}
        return [
            ActorRequest("runners", r.num_runners, self._runner_resources()),
            ActorRequest("learner", self._num_learners(), learner_bundle),
        ]

    def _make_placement_group(self) -> None:
        r = self.cfg.runners
        runners, learner = self._actor_requests()
        if self.cfg.ray.placement:
            self.role_groups = RoleGroups([runners, learner], self.cfg.ray.placement, SETUP_TIMEOUT_S)
        strategy = self.cfg.ray.placement_strategy
        if strategy is None:
            return
        from ray.util.placement_group import placement_group

        runner_bundles = [self._runner_resources() for _ in range(r.num_runners)]
        pg = placement_group([*[learner.resources] * learner.count, *runner_bundles], strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=SETUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(pg)
            raise ConfigError(
                f"ray.placement_strategy = {strategy!r}: the cluster cannot place {learner.count} learner(s) and "
                f"{r.num_runners} runners with the requested resources within {SETUP_TIMEOUT_S:g} s"
            ) from None
        self.placement_group = pg
