"""Anchor benchmark: RLlib 2.60 PPO (new API stack) throughput on HalfCheetah-v5.

What is measured (both in one process, on one local Ray instance):

* ``sampling_steps_per_s`` -- sampling-only env steps per second. The algorithm's
  ``EnvRunnerGroup`` is driven through exactly the call PPO's ``training_step``
  uses for collection (``synchronous_parallel_sample(worker_set=...,
  max_env_steps=train_batch)``), so each round is one full train batch sampled by
  the remote env runners with their current (fixed) weights and shipped back to
  the driver as episodes. No learner update and no weight sync happens. One
  warm-up round is discarded; the env steps actually returned (sum of
  ``episode.env_steps()``) over the timed rounds are divided by wall time.
  A second figure, ``sampling_in_runner_steps_per_s``, times
  ``foreach_env_runner(lambda r: <steps in r.sample()>)`` so that only step counts
  (not episodes) cross the process boundary, i.e. the sampling cost without the
  transfer of episodes to the driver.
* ``train_steps_per_s`` -- end-to-end ``algo.train()`` throughput: env steps
  sampled (RLlib's own ``env_runners/num_env_steps_sampled_lifetime`` counter,
  differenced across the timed iterations) divided by the wall time of N
  ``algo.train()`` calls after one warm-up iteration. This includes sampling,
  the 10-epoch minibatch SGD on the local (in-driver, CPU) learner, weight sync
  and metrics bookkeeping.

Why: these are the reference ("anchor") numbers that rlfabric's own sampling and
training throughput are compared against on the same machine, with the same
env/batch/epoch/minibatch settings (2 env runners x 4 envs, 4000-step batch,
10 epochs, minibatch 128, one CPU learner).

Model: by default an MLP with separate policy and value networks, 64x64 tanh
(``fcnet_hiddens=[64, 64]``, ``vf_share_layers=False``), the usual PPO-MuJoCo
setting. ``--rllib-default-model`` uses RLlib's ``DefaultModelConfig`` unchanged
(256x256 tanh, shared value layers in 2.60).

Usage::

    python benchmarks/anchor_rllib.py --iters 5 --sample-rounds 5 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import ray
from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
from ray.rllib.execution.rollout_ops import synchronous_parallel_sample
from ray.rllib.utils.metrics import (
    ENV_RUNNER_RESULTS,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
)


def log(msg: str) -> None:
    """Print a progress line to stderr."""
    print(f"[anchor_rllib {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="HalfCheetah-v5")
    p.add_argument("--iters", type=int, default=5, help="timed algo.train() iterations")
    p.add_argument("--sample-rounds", type=int, default=5, help="timed sampling-only rounds")
    p.add_argument("--num-env-runners", type=int, default=2)
    p.add_argument("--envs-per-runner", type=int, default=4)
    p.add_argument("--train-batch", type=int, default=4000)
    p.add_argument("--num-epochs", type=int, default=10)
    p.add_argument("--minibatch", type=int, default=128)
    p.add_argument("--hiddens", default="64,64", help="comma-separated MLP sizes")
    p.add_argument(
        "--rllib-default-model",
        action="store_true",
        help="use RLlib's DefaultModelConfig unchanged instead of --hiddens",
    )
    p.add_argument(
        "--num-cpus",
        type=int,
        default=None,
        help="logical CPUs for ray.init (default: max(os.cpu_count(), runners + 2))",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results to this JSON file")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> PPOConfig:
    """PPO config (new API stack, the 2.60 default) for the anchor settings."""
    if args.rllib_default_model:
        model = DefaultModelConfig()
    else:
        hiddens = [int(h) for h in args.hiddens.split(",") if h]
        model = DefaultModelConfig(fcnet_hiddens=hiddens, fcnet_activation="tanh", vf_share_layers=False)
    return (
        PPOConfig()
        .environment(args.env)
        .framework("torch")
        .env_runners(
            num_env_runners=args.num_env_runners,
            num_envs_per_env_runner=args.envs_per_runner,
            num_cpus_per_env_runner=1,
            rollout_fragment_length="auto",
        )
        .learners(num_learners=0, num_gpus_per_learner=0)
        .training(
            train_batch_size_per_learner=args.train_batch,
            num_epochs=args.num_epochs,
            minibatch_size=args.minibatch,
        )
        .rl_module(model_config=model)
        .debugging(seed=args.seed, log_level="WARN")
    )


def sample_episodes(algo: Algorithm, train_batch: int) -> list[Any]:
    """One PPO-style collection round without learning (the call RLlib's PPO makes): the episodes returned."""
    episodes, _metrics = synchronous_parallel_sample(
        worker_set=algo.env_runner_group,
        max_env_steps=train_batch,
        sample_timeout_s=algo.config.sample_timeout_s,
        _uses_new_env_runners=True,
        _return_metrics=True,
    )
    return episodes


def _sample_round(algo: Algorithm, train_batch: int) -> int:
    """One collection round; env steps returned."""
    return sum(ep.env_steps() for ep in sample_episodes(algo, train_batch))


def _runner_sample_steps(runner: Any) -> int:
    """Executed inside an env runner: sample one fragment, return only its step count."""
    episodes = runner.sample()
    runner.get_metrics()  # drain per-sample metrics so they do not accumulate
    return sum(ep.env_steps() for ep in episodes)


def _in_runner_round(algo: Algorithm) -> int:
    """All remote runners sample one fragment in parallel; only counts come back."""
    counts = algo.env_runner_group.foreach_env_runner(_runner_sample_steps, local_env_runner=False)
    return int(sum(counts))


def measure_sampling(algo: Algorithm, train_batch: int, rounds: int) -> dict[str, float]:
    """Time sampling-only rounds (fixed weights, no learner) after one warm-up round."""
    log("sampling warm-up round")
    _sample_round(algo, train_batch)
    steps = 0
    t0 = time.perf_counter()
    for i in range(rounds):
        n = _sample_round(algo, train_batch)
        steps += n
        log(f"sampling round {i + 1}/{rounds}: {n} env steps")
    dt = time.perf_counter() - t0

    _in_runner_round(algo)  # warm-up for the counts-only variant
    steps_ir = 0
    t1 = time.perf_counter()
    for _ in range(rounds):
        steps_ir += _in_runner_round(algo)
    dt_ir = time.perf_counter() - t1
    log(f"in-runner sampling: {steps_ir} env steps in {dt_ir:.2f}s")
    return {
        "sampling_steps_per_s": steps / dt,
        "sampling_env_steps": steps,
        "sampling_seconds": dt,
        "sampling_in_runner_steps_per_s": steps_ir / dt_ir,
        "sampling_in_runner_env_steps": steps_ir,
        "sampling_in_runner_seconds": dt_ir,
    }


def _lifetime_env_steps(result: dict[str, Any]) -> int:
    """RLlib's lifetime env-steps-sampled counter from a train() result."""
    return int(result[ENV_RUNNER_RESULTS][NUM_ENV_STEPS_SAMPLED_LIFETIME])


def measure_training(algo: Algorithm, iters: int) -> dict[str, float]:
    """Time `iters` algo.train() calls after one warm-up iteration."""
    log("train warm-up iteration")
    t = time.perf_counter()
    start = _lifetime_env_steps(algo.train())
    log(f"warm-up iteration took {time.perf_counter() - t:.2f}s")
    t0 = time.perf_counter()
    end = start
    for i in range(iters):
        ti = time.perf_counter()
        res = algo.train()
        end = _lifetime_env_steps(res)
        log(f"train iter {i + 1}/{iters}: {time.perf_counter() - ti:.2f}s, lifetime env steps {end}")
    dt = time.perf_counter() - t0
    steps = end - start
    return {
        "train_steps_per_s": steps / dt,
        "train_env_steps": steps,
        "train_seconds": dt,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run both measurements, print a summary line and optionally write JSON."""
    args = parse_args(argv)
    num_cpus = args.num_cpus or max(os.cpu_count() or 1, args.num_env_runners + 2)
    t_start = time.perf_counter()
    log(f"ray.init(num_cpus={num_cpus})")
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        config = build_config(args)
        log("building PPO")
        algo = config.build_algo()
        try:
            sampling = measure_sampling(algo, args.train_batch, args.sample_rounds)
            training = measure_training(algo, args.iters)
            model = algo.config.model_config
        finally:
            algo.stop()
    finally:
        ray.shutdown()

    settings: dict[str, Any] = {
        "env": args.env,
        "algo": "PPO (new API stack: EnvRunner + Learner, torch)",
        "num_env_runners": args.num_env_runners,
        "num_envs_per_env_runner": args.envs_per_runner,
        "rollout_fragment_length": config.get_rollout_fragment_length(),
        "train_batch_size": args.train_batch,
        "num_epochs": args.num_epochs,
        "minibatch_size": args.minibatch,
        "learner": "local (num_learners=0), CPU",
        "model": {
            "fcnet_hiddens": list(model["fcnet_hiddens"]),
            "fcnet_activation": model["fcnet_activation"],
            "vf_share_layers": model["vf_share_layers"],
            "rllib_default_model": args.rllib_default_model,
        },
        "sample_rounds": args.sample_rounds,
        "train_iters": args.iters,
        "warmup": "1 sampling round + 1 train iteration, not timed",
        "ray_num_cpus": num_cpus,
        "os_cpu_count": os.cpu_count(),
        "train_steps_source": "diff of env_runners/num_env_steps_sampled_lifetime",
        "sampling_method": "synchronous_parallel_sample(max_env_steps=train_batch) "
        "on algo.env_runner_group, episodes returned to driver",
        "seed": args.seed,
    }
    out: dict[str, Any] = {
        "framework": "rllib",
        "ray_version": ray.__version__,
        "sampling_steps_per_s": sampling["sampling_steps_per_s"],
        "train_steps_per_s": training["train_steps_per_s"],
        "details": {**sampling, **training, "total_wall_s": time.perf_counter() - t_start},
        "settings": settings,
    }
    print(
        f"rllib {ray.__version__} PPO {args.env}: sampling {out['sampling_steps_per_s']:.0f} "
        f"env steps/s (in-runner {sampling['sampling_in_runner_steps_per_s']:.0f}), "
        f"train {out['train_steps_per_s']:.0f} env steps/s "
        f"({args.num_env_runners}x{args.envs_per_runner} envs, batch {args.train_batch}, "
        f"{args.num_epochs} epochs, mb {args.minibatch})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        log(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
