"""Where a run's actors go on a Ray cluster: whether they can be placed, decided before any actor starts; a
placement group per role; and the plan of where each actor went.

An actor Ray cannot place waits forever; data-parallel learners that cannot all be placed never form their
process group. Both are a silent hang unless the request is checked against the cluster first (``check_fits``).

``ray.placement: {rollout: SPREAD, learner: STRICT_PACK}`` reserves one bundle per actor of each named role (its
``num_cpus`` / ``num_gpus`` / ``resources``) with that strategy (``RoleGroups``): SPREAD puts a role's actors on as
many nodes as it can (rollout workers across rollout nodes), PACK / STRICT_PACK keeps them together (data-parallel
learners on one node, for their process group). Roles not named are placed by Ray alone. A group the cluster
cannot place within the deadline is one line naming the role, the strategy and what its bundles ask for, before
any actor starts. ``actor_nodes`` asks each actor where it runs (Ray's ``__ray_call__``, so no actor class needs a
method for it), and ``plan_lines`` says it: one line per role, its actors' indices per node.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfabric.actor_slots import fits_on_a_node
from rlfabric.actor_slots import format_resources as _fmt
from rlfabric.config_base import ConfigError


@dataclass(frozen=True)
class ActorRequest:
    """``count`` actors of one role, each asking for ``resources`` (Ray names: "CPU", "GPU", custom)."""

    role: str  # the config section that sets it, e.g. "learner"
    count: int
    resources: Mapping[str, float]


def check_fits(
    requests: list[ActorRequest],
    nodes: list[Mapping[str, float]],
    cluster: str = "the cluster",
    remedy: str = "lower num_cpus/num_gpus or the actor counts, or add nodes",
) -> None:
    """Raise ConfigError when some actor fits on no node, or all of them together exceed the cluster's total.

    ``nodes``: each alive node's total resources (``ray.nodes()[i]["Resources"]``). Packing is not checked
    beyond the totals: Ray may still fail to pack requests that fit in sum, and the setup deadline covers that.
    ``cluster`` and ``remedy`` word the error.
    """
    for r in requests:
        if r.count and not fits_on_a_node(r.resources, nodes):
            largest = max(nodes, key=lambda n: n.get("CPU", 0.0), default={})
            raise ConfigError(
                f"{r.role}.num_cpus/num_gpus/resources ask for {_fmt(r.resources)} per actor, which no node of "
                f"{cluster} has (largest node: {_fmt({k: largest[k] for k in ('CPU', 'GPU') if k in largest})})"
            )
    asked: dict[str, float] = {}
    for r in requests:
        for k, v in r.resources.items():
            asked[k] = asked.get(k, 0.0) + r.count * v
    have = {k: sum(node.get(k, 0.0) for node in nodes) for k in asked}
    short = {k: v for k, v in asked.items() if v > have[k] + 1e-9}
    if short:
        parts = "; ".join(f"{r.role}: {r.count} x {_fmt(r.resources)}" for r in requests if r.count)
        raise ConfigError(
            f"the run's actors ask for {_fmt(asked)} in all ({parts}) but {cluster} has {_fmt(have)}: {remedy}"
        )


def check_fits_locally(requests: list[ActorRequest], local_cpus: float | None) -> None:
    """Before Ray starts: the CPUs the actors ask for against a local instance of ``local_cpus`` CPUs
    (``ray.num_cpus``; None: no local instance of a fixed size will start, nothing to check). GPUs are left to
    ``check_fits`` once Ray has found them."""
    if local_cpus is None:
        return
    cpu_only = [ActorRequest(r.role, r.count, {"CPU": r.resources.get("CPU", 0.0)}) for r in requests]
    check_fits(
        cpu_only,
        [{"CPU": local_cpus}],
        cluster=f"the local Ray instance of ray.num_cpus = {local_cpus:g}",
        remedy="raise ray.num_cpus (or leave it unset: the instance is then sized to the run), or lower num_cpus or "
        "the actor counts",
    )


def bundles_fit(strategy: str, count: int, bundle: Mapping[str, float], nodes: Sequence[Mapping[str, float]]) -> bool:
    """Whether ``count`` bundles can be placed with ``strategy`` on nodes with these total resources:
    STRICT_SPREAD needs ``count`` nodes that each hold a bundle, STRICT_PACK one node that holds all of them, PACK and
    SPREAD sum_n min_k floor(node_n[k] / bundle[k]) >= count over the nodes."""
    per_node = [min((int(node.get(k, 0.0) // v) for k, v in bundle.items() if v), default=0) for node in nodes]
    if strategy == "STRICT_SPREAD":
        return sum(1 for n in per_node if n >= 1) >= count
    if strategy == "STRICT_PACK":
        return any(n >= count for n in per_node)
    return sum(per_node) >= count


class RoleGroups:
    """The placement groups of the roles ``placement`` names, reserved at once and waited for (``timeout_s``)."""

    def __init__(self, asks: Sequence[ActorRequest], placement: Mapping[str, str], timeout_s: float) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.groups: dict[str, Any] = {}
        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
        for ask in asks:
            if ask.role not in placement or ask.count == 0:
                continue
            bundles = [{k: float(v) for k, v in ask.resources.items() if v} for _ in range(ask.count)]
            if not bundles[0]:
                self.remove()
                raise ConfigError(
                    f"ray.placement.{ask.role}: its actors ask for no resources, and a placement group needs some "
                    f"(set {ask.role}'s num_cpus > 0)"
                )
            if not bundles_fit(placement[ask.role], ask.count, bundles[0], nodes):
                self.remove()
                raise ConfigError(self._unplaceable(ask, placement[ask.role], "on the cluster's nodes"))
            self.groups[ask.role] = placement_group(bundles, strategy=placement[ask.role])
        for ask in asks:
            group = self.groups.get(ask.role)
            if group is None:
                continue
            try:
                ray.get(group.ready(), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - GetTimeoutError or a group Ray gave up on: the same one line
                self.remove()
                raise ConfigError(self._unplaceable(ask, placement[ask.role], f"within {timeout_s:g}s")) from None

    @staticmethod
    def _unplaceable(ask: ActorRequest, strategy: str, where: str) -> str:
        return (
            f"ray.placement.{ask.role} = {strategy!r}: the cluster could not place {ask.count} x "
            f"{{{_fmt(ask.resources)}}} {where}; free or add nodes with those resources, or choose a looser "
            "strategy (PACK, SPREAD)"
        )

    def options(self, role: str, index: int) -> dict[str, Any]:
        """Actor options that put the ``index``-th actor of ``role`` in its bundle (empty for a role with no group)."""
        group = self.groups.get(role)
        if group is None:
            return {}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index % group.bundle_count
            )
        }

    def remove(self) -> None:
        import ray

        for group in self.groups.values():
            ray.util.remove_placement_group(group)
        self.groups.clear()


def _where(_actor: Any) -> tuple[str, str]:
    import ray

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def actor_nodes(actors: Mapping[str, Sequence[Any]], timeout_s: float = 30.0) -> dict[str, list[str | None]]:
    """For each role, where each of its actors runs: ``<ip>/<node id's first 8 characters>``, or None for one that
    does not answer within ``timeout_s``."""
    import ray

    refs = {role: [a.__ray_call__.remote(_where) for a in handles] for role, handles in actors.items()}
    nodes: dict[str, list[str | None]] = {}
    for role, role_refs in refs.items():
        nodes[role] = []
        for ref in role_refs:
            try:
                node_id, ip = ray.get(ref, timeout=timeout_s)
                nodes[role].append(f"{ip}/{node_id[:8]}")
            except Exception:  # noqa: BLE001 - a plan line, not worth failing a run for
                nodes[role].append(None)
    return nodes


def plan_lines(nodes: Mapping[str, Sequence[str | None]], placement: Mapping[str, str]) -> list[str]:
    """``rollout (SPREAD): 0,2 on 10.0.0.2/1a2b3c4d; 1,3 on 10.0.0.3/5e6f7a8b``: one line per role with actors, or
    one line in all when every actor is on one node."""
    every = {node for where in nodes.values() for node in where}
    if len(every) == 1 and None not in every:
        return [f"every actor on {every.pop()}"]
    lines = []
    for role, where in nodes.items():
        if not where:
            continue
        by_node: dict[str, list[int]] = {}
        for index, node in enumerate(where):
            by_node.setdefault(node or "unknown", []).append(index)
        parts = "; ".join(f"{','.join(map(str, idx))} on {node}" for node, idx in by_node.items())
        lines.append(f"{role} ({placement.get(role) or 'any node'}): {parts}")
    return lines


PLAN_FILE = "placement.json"


def record_plan(run_dir: Path, actors: Mapping[str, Sequence[Any]], placement: Mapping[str, str]) -> list[str]:
    """Where each role's actors went, written to ``run_dir/placement.json`` (role -> {strategy, nodes}); the plan's
    lines, for the console."""
    nodes = actor_nodes(actors)
    plan = {role: {"strategy": placement.get(role), "nodes": where} for role, where in nodes.items()}
    (run_dir / PLAN_FILE).write_text(json.dumps(plan, indent=2) + "\n")
    return plan_lines(nodes, placement)
