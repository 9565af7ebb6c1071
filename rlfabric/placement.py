"""Whether a run's actors can be placed on a Ray cluster, decided before any actor starts.

An actor Ray cannot place waits forever; data-parallel learners that cannot all be placed never form their
process group. Both are a silent hang unless the request is checked against the cluster first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rlfabric.config import ConfigError


@dataclass(frozen=True)
class ActorRequest:
    """``count`` actors of one role, each asking for ``resources`` (Ray names: "CPU", "GPU", custom)."""

    role: str  # the config section that sets it, e.g. "learner"
    count: int
    resources: Mapping[str, float]


def _fmt(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(resources.items()) if v) or "nothing"


def check_fits(requests: list[ActorRequest], nodes: list[Mapping[str, float]]) -> None:
    """Raise ConfigError when some actor fits on no node, or all of them together exceed the cluster's total.

    ``nodes``: each alive node's total resources (``ray.nodes()[i]["Resources"]``). Packing is not checked
    beyond the totals: Ray may still fail to pack requests that fit in sum, and the setup deadline covers that.
    """
    for r in requests:
        if r.count and not any(all(node.get(k, 0.0) >= v for k, v in r.resources.items()) for node in nodes):
            largest = max(nodes, key=lambda n: n.get("CPU", 0.0), default={})
            raise ConfigError(
                f"{r.role}.num_cpus/num_gpus/resources ask for {_fmt(r.resources)} per actor, which no node of the "
                f"cluster has (largest node: {_fmt({k: largest[k] for k in ('CPU', 'GPU') if k in largest})})"
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
            f"the run's actors ask for {_fmt(asked)} in all ({parts}) but the cluster has {_fmt(have)}: "
            "lower num_cpus/num_gpus or the actor counts, or add nodes"
        )
