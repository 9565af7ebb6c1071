"""Scaling curve and capacity model: throughput against the number of rollout workers (PPO and GRPO), each role's
measured cost per step, and a projection of how many rollout nodes one driver and one learner can feed.

Usage::

    python benchmarks/scaling.py            # the full measurement (about 5 min on 2 quiet cores)
    python benchmarks/scaling.py --smoke    # smallest settings, 2 timed steps a point: checks the script end to end

Measured on this machine, synchronous (``training.max_policy_lag: 0``: sampling, then the update, then the weight
sync), weak scaling: every rollout worker makes the same fragment of F samples per policy version, so the train
batch grows with the number of workers N:

* PPO (``rlfabric.driver.Trainer`` on ``--env``, HalfCheetah-v5 by default): ``runners.num_runners`` = N in
  ``--ppo-workers`` (1 2 4); each runner steps ``--envs-per-runner`` envs ``--fragment-steps`` times per version
  (F = envs x steps) and ``ppo.train_batch_size`` = N F.
* GRPO (``rlfabric.llm_driver.GRPOTrainer``, the builtin character-level Qwen2, the arithmetic task):
  ``generator.num_generators`` = N in ``--grpo-workers`` (1 2 4); each generator completes
  ``--prompts-per-worker`` prompts x ``grpo.group_size`` per step (F) and ``grpo.prompts_per_step`` = N x prompts.
  ``grpo.skip_zero_advantage_rows`` is off, so the learner's cost per sample does not depend on how many groups
  happen to have reward spread.

Each point runs in a fresh local Ray instance; its first step warms up and is left out. What is measured, per point
(rows are the run's own metrics rows; the driver's CPU and wall clock are stamped as each row is logged):

  X   samples trained per second: samples of the timed steps / wall clock between their rows
  R1  one rollout worker's rate: F / its sampling seconds (PPO ``sample_time_s``; GRPO ``generate_time_s``)
  d   driver CPU seconds per step: ``time.process_time()`` of the driver process (every thread) between rows
  b   bytes the driver receives per step (GRPO ``driver_received_bytes``; PPO: each fragment's metadata and the
      learner's statistics, pickled as ``rlfabric.compact.payload_bytes`` counts them)
  t   trajectory bytes per sample (rollout worker -> learner through the object store, never the driver; GRPO
      ``trajectory_bytes``; PPO: one fragment's arrays, sampled after the run)
  l   learner seconds per step (PPO ``learn_time_s`` + ``fetch_time_s``; GRPO ``update_time_s``)
  B   bytes per weight version (PPO: the published weights object, pickled; GRPO: the model's parameters)
  s   weight-sync seconds per version here (PPO: ``Learner.publish`` and every runner's ``set_weights``, timed after
      the run; GRPO ``weight_sync_time_s``); B / s is the local transfer rate

The check against the measured curve and the capacity model that projects it to a cluster, with their
formulas: ``benchmarks/capacity_model.py``.

Writes the figures and the model to ``--out`` (benchmarks/results/scaling.json; a temporary file with --smoke) and
prints them as markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from capacity_model import check_curve, project  # benchmarks/ is the script's directory
from report import write_report

from rlfabric.compact import payload_bytes

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the builtin model is built here; nothing is downloaded
HERE = Path(__file__).resolve().parent
# What the PPO learner's update returns to the driver (actors/learner.py), found again in the iteration's row.
PPO_LEARNER_STATS = (
    "policy_loss",
    "value_loss",
    "entropy",
    "approx_kl",
    "clip_fraction",
    "lr",
    "epochs_run",
    "explained_variance",
    "learn_time_s",
    "fetch_time_s",
)
SYNC_REPEATS = 5  # PPO weight-sync timings after the run; the median is reported


# -- measuring one point ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Stamp:
    cpu_s: float  # the driver process's CPU seconds (every thread) when the row was logged
    wall_s: float
    row: dict[str, Any]


def stamp_rows(log: Any, keep: Any) -> list[Stamp]:
    """Record the driver's CPU and wall clock as each row ``keep(row)`` accepts is logged by ``log`` (a RunLog)."""
    stamps: list[Stamp] = []
    original = log.log

    def stamped(row: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if keep(row):
            stamps.append(Stamp(time.process_time(), time.perf_counter(), dict(row)))
        original(row, *args, **kwargs)

    log.log = stamped
    return stamps


def steady(stamps: list[Stamp]) -> tuple[list[dict[str, Any]], float, float]:
    """The timed steps' rows (all but the first, which warms up), the driver CPU and the wall clock they took."""
    if len(stamps) < 2:
        raise RuntimeError(f"{len(stamps)} step rows logged: at least 2 are needed (the first warms up)")
    return [s.row for s in stamps[1:]], stamps[-1].cpu_s - stamps[0].cpu_s, stamps[-1].wall_s - stamps[0].wall_s


def start_ray(num_cpus: int, env_vars: dict[str, str] | None = None) -> None:
    # address="local": a new instance even when a cluster (`ray start`) runs on this machine
    runtime_env = {"env_vars": env_vars} if env_vars else None
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)


def point(
    algo: str,
    n: int,
    fragment: int,
    rows: list[dict[str, Any]],
    cpu_s: float,
    wall_s: float,
    samples: list[float],
    parts: dict[str, list[float]],
    **extra: Any,
) -> dict[str, Any]:
    """One measured point: the steady-state rates and each role's median cost per step and per sample."""
    steps, total = len(rows), sum(samples)
    med = {k: statistics.median(v) for k, v in parts.items()}
    return {
        "algo": algo,
        "workers": n,
        "fragment": fragment,
        "batch": n * fragment,
        "timed_steps": steps,
        "samples_per_s": total / wall_s,
        "step_wall_s": wall_s / steps,
        "driver_cpu_s_per_step": cpu_s / steps,
        "driver_cpu_s_per_sample": cpu_s / total,
        "worker_rate": fragment / med["roll_s"],  # R1 as this point measured it
        **{f"{k}_median": v for k, v in med.items()},
        **extra,
    }


def ppo_config(n: int, args: argparse.Namespace) -> Any:
    from rlfabric.config import ppo_config_from_dict

    batch = n * args.envs_per_runner * args.fragment_steps
    return ppo_config_from_dict(
        {
            "env": {"id": args.env},
            "runners": {"num_runners": n, "envs_per_runner": args.envs_per_runner, "num_cpus": 1.0},
            "learner": {"num_cpus": 1.0},
            "model": {"hidden_sizes": [64, 64]},
            "ppo": {
                "train_batch_size": batch,
                "num_epochs": args.ppo_epochs,
                "minibatch_size": min(args.ppo_minibatch, batch),
                "lr": 3e-4,
                "gamma": 0.99,
                "gae_lambda": 0.95,
                "clip_value_loss": True,
                "normalize_obs": True,
                "normalize_reward": True,
            },
            "training": {
                "total_env_steps": batch * (args.steps + 1),
                "max_policy_lag": 0,
                "seed": 0,
                "checkpoint_every": 0,
                "eval_episodes": 0,
            },
        }
    )


def ppo_weight_sync(trainer: Any) -> tuple[float, float, int]:
    """(publish seconds, every runner's pull seconds, bytes) of one weight version, medians of SYNC_REPEATS: the
    learner puts the weights into the object store once, each runner reads and loads them."""
    import pickle

    publish, pull = [], []
    for _ in range(SYNC_REPEATS):
        started = time.perf_counter()
        weights_ref, _version = ray.get(trainer.learner.publish.remote())
        published = time.perf_counter()
        ray.get([runner.set_weights.remote(weights_ref) for runner in trainer.pool.runners])
        publish.append(published - started)
        pull.append(time.perf_counter() - published)
    nbytes = len(pickle.dumps(ray.get(weights_ref), protocol=5))
    return statistics.median(publish), statistics.median(pull), nbytes


def ppo_fragment_bytes(trainer: Any) -> tuple[int, int]:
    """(array bytes, env steps) of one more fragment from runner 0: what a fragment carries to the learner."""
    meta_ref, data_ref = trainer.pool.runners[0].sample.remote()
    meta, fragment = ray.get([meta_ref, data_ref])
    return fragment.nbytes(), meta["env_steps"]


def measure_ppo(n: int, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    from rlfabric.driver import Trainer

    fragment = args.envs_per_runner * args.fragment_steps
    start_ray(n + 2)
    trainer = Trainer(ppo_config(n, args), run_dir, quiet=True)
    try:
        trainer.setup()
        stamps = stamp_rows(trainer.log, lambda row: "env_steps" in row)
        meta_bytes: list[int] = []
        collect = trainer.pool.collect

        def counted(ready: list[Any]) -> Any:  # the fragments' metadata, the only sample data the driver reads
            done, failed = collect(ready)
            meta_bytes.extend(payload_bytes(c.meta) for c in done)
            return done, failed

        trainer.pool.collect = counted
        trainer.train()
        publish_s, pull_s, weight_bytes = ppo_weight_sync(trainer)
        fragment_bytes, fragment_steps = ppo_fragment_bytes(trainer)
    finally:
        trainer.close()
        ray.shutdown()
    rows, cpu_s, wall_s = steady(stamps)
    stats_bytes = statistics.median(payload_bytes({k: r[k] for k in PPO_LEARNER_STATS if k in r}) for r in rows)
    driver_bytes = statistics.median(meta_bytes) * n + stats_bytes
    batch = n * fragment
    return point(
        "ppo",
        n,
        fragment,
        rows,
        cpu_s,
        wall_s,
        [batch] * len(rows),
        {
            "roll_s": [r["sample_time_s"] for r in rows],
            "serial_s": [r["learn_time_s"] + r["fetch_time_s"] for r in rows],
            "learner_s": [r["learn_time_s"] + r["fetch_time_s"] for r in rows],
            "step_s": [b.wall_s - a.wall_s for a, b in zip(stamps, stamps[1:], strict=False)],
        },
        driver_bytes_per_step=driver_bytes,
        driver_bytes_per_sample=driver_bytes / batch,
        trajectory_bytes_per_sample=fragment_bytes / fragment_steps,
        learner_s_per_sample=statistics.median((r["learn_time_s"] + r["fetch_time_s"]) / batch for r in rows),
        weight_bytes=weight_bytes,
        weight_sync_s=publish_s + pull_s,
        weight_publish_s=publish_s,
        weight_pull_s=pull_s,
    )


def grpo_config(n: int, args: argparse.Namespace) -> Any:
    from rlfabric.config import config_from_dict

    return config_from_dict(
        {
            "algo": "grpo",
            "model": {"path": "builtin", "builtin": args.grpo_model},
            "data": {"train": "task:arithmetic?max_operand=49&ops=+", "num_train": 2000, "num_eval": 8},
            "sampling": {"max_new_tokens": args.max_new_tokens, "temperature": 1.0},
            "generator": {"backend": "torch", "num_generators": n, "num_cpus": 1.0},
            "learner": {"num_learners": 1, "num_cpus": 1.0},
            "rewards": {"functions": [{"name": "arithmetic"}], "num_cpus": 0.25},
            "grpo": {
                "prompts_per_step": n * args.prompts_per_worker,
                "group_size": args.group_size,
                "micro_batch_size": 64,
                "skip_zero_advantage_rows": False,
            },
            "sft": {"steps": 0},
            "training": {
                "total_steps": args.steps + 1,
                "max_policy_lag": 0,
                "seed": 0,
                "eval_every": 0,
                "checkpoint_every": 0,
                "show_samples": 0,
            },
        }
    )


def parameter_bytes(model_dir: str) -> int:
    """Bytes of the model's parameters as saved (what one weight version carries)."""
    from safetensors.torch import load_file

    return sum(
        t.numel() * t.element_size() for f in Path(model_dir).glob("*.safetensors") for t in load_file(f).values()
    )


def measure_grpo(n: int, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    from rlfabric.llm_actors import wanted_cpus
    from rlfabric.llm_driver import GRPOTrainer
    from rlfabric.llm_resources import openmp_env

    cfg = grpo_config(n, args)
    fragment = args.prompts_per_worker * args.group_size
    start_ray(math.ceil(wanted_cpus(cfg)) + 1, openmp_env())
    trainer = GRPOTrainer(cfg, run_dir, quiet=True)
    try:
        trainer.setup()
        stamps = stamp_rows(trainer.log, lambda row: row.get("phase") == "grpo")
        trainer.train()
        weight_bytes = parameter_bytes(trainer.base_model_dir)
    finally:
        trainer.close()
        ray.shutdown()
    rows, cpu_s, wall_s = steady(stamps)
    samples = [r["trained_samples"] for r in rows]
    return point(
        "grpo",
        n,
        fragment,
        rows,
        cpu_s,
        wall_s,
        samples,
        {
            "roll_s": [r["generate_time_s"] for r in rows],
            "serial_s": [r["reward_time_s"] + r["update_time_s"] for r in rows],
            "learner_s": [r["update_time_s"] for r in rows],
            "reward_s": [r["reward_time_s"] for r in rows],
            "step_s": [r["step_time_s"] for r in rows],
        },
        driver_bytes_per_step=statistics.median(r["driver_received_bytes"] for r in rows),
        driver_bytes_per_sample=statistics.median(r["driver_received_bytes"] / r["trained_samples"] for r in rows),
        trajectory_bytes_per_sample=statistics.median(r["trajectory_bytes"] / r["trained_samples"] for r in rows),
        learner_s_per_sample=statistics.median(r["update_time_s"] / r["trained_samples"] for r in rows),
        weight_bytes=weight_bytes,
        weight_sync_s=statistics.median(r["weight_sync_time_s"] for r in rows),
    )


# -- the model against the curve, and the projection ----------------------------------------------------------------


# -- output ---------------------------------------------------------------------------------------------------------


def fmt(x: float) -> str:
    if math.isinf(x):
        return "inf"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def print_tables(points: dict[str, list[dict[str, Any]]], models: dict[str, dict[str, Any]], args: Any) -> None:
    print("\n### Measured: throughput against rollout workers (sync, weak scaling)\n")
    print(
        "| algo | workers | batch | samples/s | predicted | measured / predicted | step wall s | driver CPU ms/step "
        "| driver CPU us/sample | driver bytes/step | learner us/sample | weight bytes | weight sync ms |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for algo, pts in points.items():
        for p in pts:
            print(
                f"| {algo} | {p['workers']} | {p['batch']} | {fmt(p['samples_per_s'])} "
                f"| {fmt(p['predicted_samples_per_s'])} | {p['measured_over_predicted']:.2f} | {p['step_wall_s']:.3f} "
                f"| {1e3 * p['driver_cpu_s_per_step']:.1f} | {1e6 * p['driver_cpu_s_per_sample']:.1f} "
                f"| {fmt(p['driver_bytes_per_step'])} | {1e6 * p['learner_s_per_sample']:.1f} "
                f"| {fmt(p['weight_bytes'])} | {1e3 * p['weight_sync_s']:.1f} |"
            )
    bw_text = f"{args.bandwidth_gbps:g} Gb/s"
    print(f"\n### Per-version costs: a + w W seconds (W workers), links of {bw_text}\n")
    print("| algo | role | a: fixed ms | w: ms per worker | per sample |")
    print("| --- | --- | ---: | ---: | --- |")
    units = {
        "driver_cpu": lambda m: f"{1e6 * m['per_sample']['driver_cpu_s']:.2f} us CPU",
        "driver_link": lambda m: f"{m['per_sample']['driver_bytes']:.1f} B",
        "learner": lambda m: f"{1e6 * m['per_sample']['learner_s']:.1f} us",
        "learner_link": lambda m: f"{m['per_sample']['trajectory_bytes']:.0f} B",
        "weight_sync": lambda m: f"{fmt(m['per_sample']['weight_bytes_per_version'])} B per version per node",
    }
    for algo, m in models.items():
        inp = m["inputs"]
        print(f"| {algo} | rollout | {1e3 * inp['fragment'] / inp['r1']:.1f} | 0 | R1 = {fmt(inp['r1'])} samples/s |")
        for role, (fixed, per_worker) in inp["per_version"].items():
            print(f"| {algo} | {role} | {1e3 * fixed:.3f} | {1e3 * per_worker:.4f} | {units[role](m)} |")
    print(f"\n### Projection: nodes of {args.workers_per_node} workers, one driver, one learner, links of {bw_text}\n")
    print(
        "| algo | N_driver | N_driver_link | N_learner | N_learner_link | N_sync | bottleneck | weight sync here MB/s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for algo, m in models.items():
        lim = m["node_limits"]
        print(
            f"| {algo} | {fmt(lim['driver_cpu'])} | {fmt(lim['driver_link'])} "
            f"| {fmt(lim['learner'])} | {fmt(lim['learner_link'])} | {fmt(lim['weight_sync'])} | {m['bottleneck']} "
            f"| {m['local_weight_rate_bytes_per_s'] / 1e6:,.1f} |"
        )
    print("\n| algo | nodes | samples/s, roles overlapped | bound by | samples/s, sync mode |")
    print("| --- | ---: | ---: | --- | ---: |")
    for algo, m in models.items():
        for row in m["curve"]:
            print(
                f"| {algo} | {row['nodes']} | {fmt(row['overlapped'])} | {row['bound_by']} | {fmt(row['sync_mode'])} |"
            )
    print(
        "\nT_role(N) = a + w N c seconds per version (rollout: F/R1); N_role = (F/R1 - a) / (w c); "
        "X(N) = N c F / max_role T_role(N); X_sync(N) = N c F / max(F/R1 + T_learner + T_sync, T_driver, "
        "T_driver_link, T_learner_link). Local check: X_pred(N) = N F / (T_roll max(1, N/K)/max(1, N0/K) "
        "+ T_serial N/N0 + T_fixed), from the smallest point N0."
    )


SMOKE = {
    "ppo_workers": [1, 2],
    "grpo_workers": [1, 2],
    "steps": 2,
    "envs_per_runner": 2,
    "fragment_steps": 32,
    "ppo_epochs": 1,
    "ppo_minibatch": 64,
    "prompts_per_worker": 2,
    "group_size": 4,
    "max_new_tokens": 4,
    "grpo_model": {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "max_positions": 64},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="smallest settings, 2 timed steps a point")
    parser.add_argument("--algos", nargs="+", default=["ppo", "grpo"], choices=["ppo", "grpo"])
    parser.add_argument("--ppo-workers", type=int, nargs="+", default=[1, 2, 4], help="runners.num_runners")
    parser.add_argument("--grpo-workers", type=int, nargs="+", default=[1, 2, 4], help="generator.num_generators")
    parser.add_argument("--steps", type=int, default=8, help="timed steps a point (one more warms up)")
    parser.add_argument("--env", default="gym:HalfCheetah-v5")
    parser.add_argument("--envs-per-runner", type=int, default=4)
    parser.add_argument("--fragment-steps", type=int, default=250, help="steps of each env per fragment")
    parser.add_argument("--ppo-epochs", type=int, default=10)
    parser.add_argument("--ppo-minibatch", type=int, default=128)
    parser.add_argument("--prompts-per-worker", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--cores", type=float, default=float(os.cpu_count() or 1), help="K of the local check")
    parser.add_argument("--workers-per-node", type=int, default=16, help="c of the projection")
    parser.add_argument("--bandwidth-gbps", type=float, default=10.0, help="BW of the projection's links")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="projected node counts")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/scaling.json")
    args = parser.parse_args()
    args.grpo_model = {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "max_positions": 128}
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be at least 1")
    if args.out is None:  # a smoke run's figures are not results
        smoke_dir = Path(tempfile.mkdtemp(prefix="rlfabric-scaling-")) if args.smoke else None
        args.out = smoke_dir / "scaling_smoke.json" if smoke_dir else HERE / "results" / "scaling.json"

    started = time.perf_counter()
    measure = {"ppo": (measure_ppo, args.ppo_workers), "grpo": (measure_grpo, args.grpo_workers)}
    points: dict[str, list[dict[str, Any]]] = {}
    models: dict[str, dict[str, Any]] = {}
    bw = args.bandwidth_gbps * 1e9 / 8
    with tempfile.TemporaryDirectory() as tmp:
        for algo in args.algos:
            run, workers = measure[algo]
            points[algo] = []
            for n in sorted(workers):
                began = time.perf_counter()
                p = run(n, args, Path(tmp) / f"{algo}-{n}")
                points[algo].append(p)
                print(
                    f"{algo} x{n}: {p['samples_per_s']:,.0f} samples/s ({time.perf_counter() - began:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            check_curve(points[algo], args.cores)
            models[algo] = project(points[algo], args.workers_per_node, bw, args.nodes)
    print_tables(points, models, args)
    took = time.perf_counter() - started
    print(f"\ntook {took:.0f} s", file=sys.stderr)
    command = " ".join(["python", "benchmarks/scaling.py", *sys.argv[1:]])
    write_report(
        args.out, "scaling", args, command=command, seconds=took, points=points, capacity_model=models,
        assumptions={"workers_per_node": args.workers_per_node, "bandwidth_bytes_per_s": bw, "cores": args.cores},
    )  # fmt: skip


if __name__ == "__main__":
    main()
