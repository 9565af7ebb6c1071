"""Seconds per GRPO step: rlfabric vs TRL's GRPOTrainer, on CPU, in one run.

Same model (a randomly initialised 4-layer, 256-wide Qwen2-style model with the character tokenizer), same batch
(8 prompts x 8 generations x up to 32 new tokens, temperature 1), same reward (the built-in ``arithmetic`` reward,
components weighted correct 1.0 + format 0.1), one optimizer step per GRPO step, no KL term, token-mean loss.

    python benchmarks/grpo_step_vs_trl.py [--steps 10] [--warmup 2] [--threads 2] [--precisions float32 bfloat16]

Each precision runs both frameworks, in turn: ``float32`` (rlfabric's default; TRL with ``bf16=False``, the
anchor) and ``bfloat16`` matmuls with float32 weights (rlfabric's ``learner.matmul_dtype`` and
``generator.matmul_dtype``; TRL's own default ``bf16=True`` mixed precision). Ratios are against the float32 TRL
anchor and against TRL at the same precision. rlfabric also runs once with ``grpo.skip_zero_advantage_rows: false``:
its learner then computes every row, as TRL does, instead of skipping rows whose advantage is 0 (exact: their
gradient is zero). With this randomly initialised model nearly every group's rewards are all 0, so the skip removes
most of the learner's work here; on a task where every group has signal it removes none.

rlfabric's step time is the driver's ``step_time_s`` (generation, reward actors, advantages, learner update and
weight sync to the generator), split into its ``*_time_s`` parts; TRL's is its optimizer step (generation, reward,
loss, backward, update). Writes benchmarks/results/grpo_step_vs_trl.json.
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


EVERY_ROW = ", every row"  # grpo.skip_zero_advantage_rows: false
PARTS = ("generate_time_s", "reward_time_s", "update_time_s", "weight_sync_time_s")


def rlfabric_seconds_per_step(
    model_dir: str,
    steps: int,
    warmup: int,
    threads: int,
    lr: float,
    matmul_dtype: str = "float32",
    skip_zero_advantage_rows: bool = True,
) -> dict:
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
            "grpo": {
                "prompts_per_step": 8,
                "group_size": 8,
                "micro_batch_size": 64,
                "lr": lr,
                "skip_zero_advantage_rows": skip_zero_advantage_rows,
            },
            "generator": {"matmul_dtype": matmul_dtype},
            "learner": {"matmul_dtype": matmul_dtype},
            "sft": {"steps": 0},
            "training": {"total_steps": steps + warmup, "eval_every": 0, "checkpoint_every": 0, "show_samples": 0},
            "ray": {"num_cpus": max(threads, 2) + 2},
        }
    )
    with tempfile.TemporaryDirectory() as run_dir:
        train_llm(cfg, run_dir, quiet=True)
        rows = [r for r in read_metrics(Path(run_dir)) if r.get("phase") == "grpo"]
    ray.shutdown()
    rows = rows[warmup:]
    times = [r["step_time_s"] for r in rows]
    return {
        "seconds_per_step_median": statistics.median(times),
        "seconds_per_step_mean": statistics.fmean(times),
        "parts_median": {part: statistics.median(r[part] for r in rows) for part in PARTS},
        "logprob_gap_median": statistics.median(r["logprob_gap"] for r in rows),
        "trained_rows_mean": statistics.fmean(r["trained_rows"] for r in rows),
        "steps": len(times),
        "samples_per_step": 64,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--precisions", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    args = parser.parse_args()

    import torch
    from anchor_trl_grpo import run_trl_grpo

    from rlfabric.envs.text_tasks import arithmetic_rows
    from rlfabric.models.hf import build_small_model_dir
    from rlfabric.rewards import resolve_reward

    torch.set_num_threads(args.threads)
    ours: dict[str, dict] = {}
    trl: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_small_model_dir(Path(tmp) / "model", num_layers=4, hidden_size=256, num_heads=4))
        for precision in args.precisions:
            for label, skip in (("", True), (EVERY_ROW, False)):
                started = time.perf_counter()
                ours[precision + label] = rlfabric_seconds_per_step(
                    model_dir, args.steps, args.warmup, args.threads, args.lr, precision, skip
                )
                median = ours[precision + label]["seconds_per_step_median"]
                print(f"rlfabric {precision}{label}: {median:.3f} s/step ({time.perf_counter() - started:.0f}s)")
            trl[precision] = run_trl_grpo(
                model_dir,
                arithmetic_rows(2000, seed=0),
                resolve_reward("arithmetic"),
                steps=args.steps,
                warmup_steps=args.warmup,
                threads=args.threads,
                lr=args.lr,
                reward_weights=WEIGHTS,
                bf16=precision == "bfloat16",
                output_dir=str(Path(tmp) / f"trl-{precision}"),
            )
            print(f"TRL      {precision}: {trl[precision]['seconds_per_step_median']:.3f} s/step")

    anchor_precision = "float32" if "float32" in trl else args.precisions[0]
    anchor = trl[anchor_precision]["seconds_per_step_median"]
    speedups = {}
    print(f"\n{'contender':<40}{'s/step':>8}{'vs TRL ' + anchor_precision:>18}{'vs TRL same precision':>24}")
    for name, result in ours.items():
        precision = name.removesuffix(EVERY_ROW)
        mine, theirs = result["seconds_per_step_median"], trl[precision]["seconds_per_step_median"]
        speedups[name] = {"vs_trl_anchor": anchor / mine, "vs_trl_same_precision": theirs / mine}
        print(f"{'rlfabric ' + name:<40}{mine:>8.3f}{anchor / mine:>17.2f}x{theirs / mine:>23.2f}x")
        parts = ", ".join(f"{k.removesuffix('_time_s')} {v:.3f}" for k, v in result["parts_median"].items())
        print(f"    parts (s): {parts}; rows trained per step {result['trained_rows_mean']:.1f} of 64")
    for precision, result in trl.items():
        theirs = result["seconds_per_step_median"]
        print(f"{'TRL ' + precision:<40}{theirs:>8.3f}{anchor / theirs:>17.2f}x{1.0:>23.2f}x")
    best = max(s["vs_trl_anchor"] for s in speedups.values())
    print(f"rlfabric's best is {best:.2f}x faster per GRPO step than the TRL {anchor_precision} anchor (target 3x)")
    out = {
        "rlfabric": ours,
        "trl": trl,
        "speedups": speedups,
        "anchor": f"TRL {anchor_precision}",
        "threads": args.threads,
        "command": " ".join(["python", "benchmarks/grpo_step_vs_trl.py", *sys.argv[1:]]),
    }
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "grpo_step_vs_trl.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
