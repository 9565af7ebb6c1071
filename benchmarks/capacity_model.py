"""The capacity model behind ``benchmarks/scaling.py``: pure functions from the measured points to the check of
the local curve and the projection to a cluster.

Check against the measured curve (K = ``--cores`` cores, sync mode), from the smallest point N0's step parts:

  T(N) = T_roll * max(1, N/K) / max(1, N0/K) + T_serial * N / N0 + T_fixed,      X_pred(N) = N F / T(N)

T_roll is the sampling phase (the workers run in parallel until the cores run out), T_serial the roles that take
the whole batch (the learner; GRPO's reward service), T_fixed the rest of the step (weight sync, the driver's loop).
Reported: X / X_pred at each N (1.00 at N0 by construction).

Projection to a cluster: N nodes of c = ``--workers-per-node`` rollout workers (one per core) at R1 each, one
fragment of F samples per worker per version (the weak scaling measured here), the driver and the learner on
machines of their own, links of BW = ``--bandwidth-gbps``. Each role's seconds per version is a line in the number
of workers W = N c, fixed part a plus w per worker, a and w fitted over the measured points (least squares; one
point: a = 0):

  rollout       F / R1                        (the workers sample in parallel)
  driver CPU    a_d + w_d W                   (d against the workers)
  driver link   (a_b + w_b W) / BW            (b against the workers)
  learner       a_l + w_l W                   (l against the workers)
  learner link  t F W / BW                    (every sample's trajectory reaches the learner)
  weight sync   s + N B / BW                  (publishing and loading as measured here, then every node pulls the
                                               version once, Ray keeps one copy per node; all from the learner's
                                               node at worst)

A role is the bottleneck once it takes longer per version than a fragment takes to sample: N_role, the nodes at
which a + w N c = F / R1, is N_role = (F / R1 - a) / (w c). With a = 0 (and s = 0) these are the closed forms
N_driver = 1 / (d' c R1) (d' = w_d / F, driver CPU per sample), N_learner = 1 / (l' c R1), N_driver_link =
BW / (b' c R1), N_learner_link = BW / (t c R1) and N_sync = F BW / (B R1). N_max is the smallest of them and names
the bottleneck. Throughput at N nodes, roles overlapping (``max_policy_lag >= 1``): X(N) = N c F / max_role
T_role(N); in sync mode (lag 0) the update and the sync follow the sampling instead: X_sync(N) = N c F /
max(F / R1 + T_learner(N) + T_sync(N), T_driver(N), T_driver_link(N), T_learner_link(N)).

What the model leaves out: the learner measured here is one CPU core (a GPU learner divides w_l by its speed-up,
and R1 of a GPU generator is its own measured rate); GRPO's rollouts pass through one rollout worker actor (it
splits a step's prompts over the generators and has them scored), whose CPU is inside ``generate_time_s`` and
``reward_time_s``, not a line of its own; Ray's control traffic counts only as far as it runs in the driver process.

"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any


def local_step_seconds(n: int, n0: int, cores: float, roll_s: float, serial_s: float, fixed_s: float) -> float:
    """One synchronous step with ``n`` workers on ``cores`` cores, from the parts measured with ``n0`` workers:
    T(n) = roll_s * max(1, n/K) / max(1, n0/K) + serial_s * n / n0 + fixed_s."""
    return roll_s * max(1.0, n / cores) / max(1.0, n0 / cores) + serial_s * n / n0 + fixed_s


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, w) of y = a + w x by least squares, w = cov(x, y) / var(x), a = mean(y) - w mean(x); one point: (0, y/x).
    Kept non-negative: w < 0 gives (mean(y), 0), a < 0 gives the line through 0, w = sum(x y) / sum(x^2)."""
    if len(set(xs)) < 2:
        return 0.0, statistics.fmean(ys) / statistics.fmean(xs)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    w = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    if w < 0:
        return my, 0.0
    if my - w * mx < 0:
        return 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return my - w * mx, w


@dataclasses.dataclass
class RoleCosts:
    """Each role's seconds per policy version as (a, w): a + w W with W rollout workers (one fragment each)."""

    r1: float  # R1: one rollout worker's samples/s
    fragment: int  # F: one worker's samples per version
    per_version: dict[str, tuple[float, float]]

    def seconds(self, role: str, workers: float) -> float:
        a, w = self.per_version[role]
        return a + w * workers


def node_limits(c: RoleCosts, per_node: int) -> dict[str, float]:
    """Nodes of ``per_node`` workers at which each role takes as long per version as sampling a fragment (F/R1):
    N_role = (F/R1 - a) / (w c); inf for a role whose time does not grow with the workers (w = 0) and fits, 0 for
    one whose fixed part alone is longer."""
    period = c.fragment / c.r1
    limits = {}
    for role, (a, w) in c.per_version.items():
        if a >= period:
            limits[role] = 0.0
        else:
            limits[role] = math.inf if w <= 0 else (period - a) / (w * per_node)
    return limits


def projected_throughput(n: int, c: RoleCosts, per_node: int) -> dict[str, Any]:
    """Samples/s of ``n`` nodes: roles overlapping, X = N c F / max_role T_role(N) (and the role that sets it);
    sync mode, X_sync = N c F / max(F/R1 + T_learner + T_sync, T_driver, T_driver_link, T_learner_link)."""
    workers = n * per_node
    times = {"rollout": c.fragment / c.r1, **{role: c.seconds(role, workers) for role in c.per_version}}
    bound = max(times, key=times.get)
    serial = times["rollout"] + times["learner"] + times["weight_sync"]
    sync_period = max(serial, *(times[r] for r in ("driver_cpu", "driver_link", "learner_link")))
    batch = workers * c.fragment
    return {"overlapped": batch / times[bound], "bound_by": bound, "sync_mode": batch / sync_period}


def check_curve(points: list[dict[str, Any]], cores: float) -> None:
    """Add X_pred (``local_step_seconds`` from the smallest point's step parts) and X / X_pred to every point."""
    ref = min(points, key=lambda p: p["workers"])
    roll, serial = ref["roll_s_median"], ref["serial_s_median"]
    fixed = max(0.0, ref["step_wall_s"] - roll - serial)
    for p in points:
        step = local_step_seconds(p["workers"], ref["workers"], cores, roll, serial, fixed)
        p["predicted_samples_per_s"] = p["batch"] / step
        p["measured_over_predicted"] = p["samples_per_s"] / p["predicted_samples_per_s"]


def project(points: list[dict[str, Any]], per_node: int, bw: float, nodes: list[int]) -> dict[str, Any]:
    """The capacity model: R1 at the smallest point, each role's seconds per version fitted against the workers
    (trajectory and weight bytes at the largest point), each role's node limit, the bottleneck and the projected
    throughput at ``nodes`` nodes."""
    small = min(points, key=lambda p: p["workers"])
    large = max(points, key=lambda p: p["workers"])
    workers = [float(p["workers"]) for p in points]

    def fit(key: str, scale: float = 1.0) -> tuple[float, float]:
        a, w = linear_fit(workers, [p[key] for p in points])
        return a * scale, w * scale

    fragment = large["fragment"]
    costs = RoleCosts(
        r1=small["worker_rate"],
        fragment=fragment,
        per_version={
            "driver_cpu": fit("driver_cpu_s_per_step"),
            "driver_link": fit("driver_bytes_per_step", 1 / bw),
            "learner": fit("learner_s_median"),
            "learner_link": (0.0, large["trajectory_bytes_per_sample"] * fragment / bw),
            "weight_sync": (large["weight_sync_s"], large["weight_bytes"] / (bw * per_node)),
        },
    )
    limits = node_limits(costs, per_node)
    bottleneck = min(limits, key=limits.get)
    return {
        "inputs": dataclasses.asdict(costs),
        "per_sample": {  # the line's slope per sample: d', b', l' of the closed forms
            "driver_cpu_s": costs.per_version["driver_cpu"][1] / fragment,
            "driver_bytes": fit("driver_bytes_per_step")[1] / fragment,
            "learner_s": costs.per_version["learner"][1] / fragment,
            "trajectory_bytes": large["trajectory_bytes_per_sample"],
            "weight_bytes_per_version": large["weight_bytes"],
        },
        "local_weight_rate_bytes_per_s": large["weight_bytes"] / max(large["weight_sync_s"], 1e-9),
        "node_limits": limits,
        "bottleneck": bottleneck,
        "max_nodes": limits[bottleneck],
        "curve": [{"nodes": k, **projected_throughput(k, costs, per_node)} for k in nodes],
    }
