"""rlfabric's PPO throughput on one env: sampling-only and end-to-end training env steps/s.

* ``sampling_steps_per_s``: the runners sample full train batches with fixed weights, round after round (each
  round: every runner makes one fragment; the driver waits for all of them), no learner. Fragments stay in the
  object store; the driver counts steps from their metadata. One warm-up round is discarded.
* ``train_steps_per_s``: ``Trainer.train()`` end to end (sampling, GAE, the PPO epochs, weight publishing), env
  steps trained divided by wall time, over the iterations after the first (which pays for actor start-up).

Usage::

    python benchmarks/rlfabric_throughput.py --env gym:HalfCheetah-v5 --json OUT.json [--max-policy-lag 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import ray

from rlfabric.config import Config
from rlfabric.config import ppo_config_from_dict as config_from_dict
from rlfabric.driver import Trainer


def make_config(args: argparse.Namespace, total_env_steps: int) -> Config:
    return config_from_dict(
        {
            "env": {"id": args.env},
            "runners": {"num_runners": args.num_runners, "envs_per_runner": args.envs_per_runner},
            "model": {"hidden_sizes": [64, 64]},
            "ppo": {
                "train_batch_size": args.train_batch,
                "num_epochs": args.num_epochs,
                "minibatch_size": args.minibatch,
                "lr": 3e-4,
                "gamma": 0.99,
                "gae_lambda": 0.95,
                "clip_value_loss": True,
                "normalize_obs": True,
                "normalize_reward": True,
            },
            "training": {
                "total_env_steps": total_env_steps,
                "max_policy_lag": args.max_policy_lag,
                "checkpoint_every": 0,
                "eval_episodes": 0,
            },
        }
    )


def sampling_only(args: argparse.Namespace) -> float:
    trainer = Trainer(make_config(args, args.train_batch), tempfile.mkdtemp(prefix="rlfabric-bench-"), quiet=True)
    trainer.setup()
    pool = trainer.pool
    try:
        steps, seconds = 0, 0.0
        for round_index in range(args.sample_rounds + 1):
            start = time.perf_counter()
            done = pool.sample_round()
            elapsed = time.perf_counter() - start
            if round_index > 0:  # round 0 warms up
                steps += sum(c.meta["env_steps"] for c in done)
                seconds += elapsed
            print(f"  sampling round {round_index}: {elapsed:.2f} s", file=sys.stderr)
        return steps / seconds
    finally:
        trainer.close()


def training(args: argparse.Namespace) -> float:
    run_dir = Path(tempfile.mkdtemp(prefix="rlfabric-bench-"))
    trainer = Trainer(make_config(args, args.train_batch * (args.iters + 1)), run_dir, quiet=True)
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:]
    seconds = rows[-1]["time_total_s"] - rows[0]["time_total_s"]
    return sum(r["env_steps"] - p["env_steps"] for p, r in zip(rows, timed, strict=False)) / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="gym:HalfCheetah-v5")
    p.add_argument("--num-runners", type=int, default=2)
    p.add_argument("--envs-per-runner", type=int, default=4)
    p.add_argument("--train-batch", type=int, default=4000)
    p.add_argument("--num-epochs", type=int, default=10)
    p.add_argument("--minibatch", type=int, default=128)
    p.add_argument("--max-policy-lag", type=int, default=0)
    p.add_argument("--sample-rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=8, help="timed training iterations")
    p.add_argument("--mode", choices=["both", "sampling", "training"], default="both")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    ray.init(num_cpus=max(4, args.num_runners + 2), include_dashboard=False, log_to_driver=False)
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    result: dict = {"framework": "rlfabric", "settings": settings}
    if args.mode in ("both", "sampling"):
        result["sampling_steps_per_s"] = sampling_only(args)
    if args.mode in ("both", "training"):
        result["train_steps_per_s"] = training(args)
    ray.shutdown()
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
