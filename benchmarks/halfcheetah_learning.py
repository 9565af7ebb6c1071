"""Learning benchmark: PPO on HalfCheetah-v5 for 1M env steps with examples/halfcheetah_ppo.yaml.

Reports the final ``episode_return_mean`` (mean of the last 100 training episodes, stochastic policy), the
deterministic evaluation return, and wall-clock time, next to CleanRL's published PPO figure at 1M steps
(``ppo_continuous_action.py`` on HalfCheetah-v4: 1442 +- 46 over seeds, same hyperparameters on 1 env).
Copies the learning curve to ``benchmarks/results/``.

Usage::

    python benchmarks/halfcheetah_learning.py [--seeds 0 1 2] [--steps 1000000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent / "examples" / "halfcheetah_ppo.yaml"
CLEANRL_1M = (1442.0, 46.0)


def run_seed(seed: int, steps: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"rlfabric-hc-seed{seed}-"))
    cmd = ["rlfabric", "train", str(CONFIG), f"training.seed={seed}", f"training.total_env_steps={steps}",
           "--run-dir", str(run_dir)]  # fmt: skip
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    start = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - start
    summary = json.loads((run_dir / "summary.json").read_text())
    shutil.copy(run_dir / "learning_curve.png", HERE / "results" / f"halfcheetah_learning_seed{seed}.png")
    return {
        "seed": seed,
        "env_steps": summary["env_steps"],
        "episode_return_mean": summary["episode_return_mean"],
        "eval_return_mean": summary["eval_return_mean"],
        "train_time_s": summary["time_total_s"],
        "wall_clock_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--out", default=str(HERE / "results" / "halfcheetah_learning.json"))
    args = p.parse_args()
    (HERE / "results").mkdir(exist_ok=True)
    runs = [run_seed(seed, args.steps) for seed in args.seeds]
    print("\n| seed | env steps | return (last 100 episodes) | eval return | wall clock |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in runs:
        print(f"| {r['seed']} | {r['env_steps']:,} | {r['episode_return_mean']:.0f} | {r['eval_return_mean']:.0f} | "
              f"{r['wall_clock_s'] / 60:.1f} min |")  # fmt: skip
    print(f"CleanRL PPO at 1M steps (HalfCheetah-v4): {CLEANRL_1M[0]:.0f} +- {CLEANRL_1M[1]:.0f}")
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "runs": runs,
                                          "cleanrl_1m": CLEANRL_1M}, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
