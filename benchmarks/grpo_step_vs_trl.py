"""Seconds per GRPO step: rlfabric vs TRL's GRPOTrainer, on CPU, in one run.

Same model (a randomly initialised 4-layer, 256-wide Qwen2-style model with the character tokenizer), same batch
(8 prompts x 8 generations x up to 32 new tokens, temperature 1), same reward (the built-in ``arithmetic`` reward,
components weighted correct 1.0 + format 0.1), one optimizer step per GRPO step, no KL term, token-mean loss.

    python benchmarks/grpo_step_vs_trl.py [--steps 10] [--warmup 2] [--threads 2]

rlfabric's step time is the driver's ``step_time_s`` (generation, reward actors, advantages, learner update and
weight sync to the generator); TRL's is its optimizer step (generation, reward, loss, backward, update). Writes
benchmarks/results/grpo_step_vs_trl.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

WEIGHTS = {"correct": 1.0, "format": 0.1}


def rlfabric_seconds_per_step(model_dir: str, steps: int, warmup: int, threads: int, lr: float) -> dict:
    import ray

    from rlfabric.config import config_from_dict
    from rlfabric.llm_driver import train_llm
    from rlfabric.run_log import read_metrics

    cfg = config_from_dict(
        {
            "algo": "grpo",
            "model": {"path": model_dir},
            "data": {"train": "task:arithmetic", "num_train": 2000, "num_eval": 8},
            "sampling": {"max_new_tokens": 32, "temperature": 1.0},
            "rewards": {"functions": [{"name": "arithmetic"}], "weights": WEIGHTS},
            "grpo": {"prompts_per_step": 8, "group_size": 8, "micro_batch_size": 64, "lr": lr},
            "sft": {"steps": 0},
            "training": {"total_steps": steps + warmup, "eval_every": 0, "checkpoint_every": 0, "show_samples": 0},
            "ray": {"num_cpus": max(threads, 2) + 2},
        }
    )
    with tempfile.TemporaryDirectory() as run_dir:
        train_llm(cfg, run_dir, quiet=True)
        rows = [r for r in read_metrics(Path(run_dir)) if r.get("phase") == "grpo"]
    ray.shutdown()
    times = [r["step_time_s"] for r in rows][warmup:]
    return {
        "seconds_per_step_median": statistics.median(times),
        "seconds_per_step_mean": statistics.fmean(times),
        "steps": len(times),
        "samples_per_step": 64,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    args = parser.parse_args()

    import torch
    from anchor_trl_grpo import run_trl_grpo

    from rlfabric.envs.text_tasks import arithmetic_rows
    from rlfabric.models.hf import build_small_model_dir
    from rlfabric.rewards import resolve_reward

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_small_model_dir(Path(tmp) / "model", num_layers=4, hidden_size=256, num_heads=4))
        started = time.perf_counter()
        ours = rlfabric_seconds_per_step(model_dir, args.steps, args.warmup, args.threads, args.lr)
        print(f"rlfabric: {ours['seconds_per_step_median']:.3f} s/step ({time.perf_counter() - started:.0f}s)")
        trl = run_trl_grpo(
            model_dir,
            arithmetic_rows(2000, seed=0),
            resolve_reward("arithmetic"),
            steps=args.steps,
            warmup_steps=args.warmup,
            threads=args.threads,
            lr=args.lr,
            reward_weights=WEIGHTS,
            output_dir=str(Path(tmp) / "trl"),
        )
        print(f"TRL:      {trl['seconds_per_step_median']:.3f} s/step")
    ratio = trl["seconds_per_step_median"] / ours["seconds_per_step_median"]
    print(f"rlfabric is {ratio:.2f}x faster per GRPO step (target 3x)")
    out = {"rlfabric": ours, "trl": trl, "speedup": ratio, "threads": args.threads, "command": " ".join(sys.argv)}
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "grpo_step_vs_trl.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
