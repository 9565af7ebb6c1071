"""Seconds per GRPO step: rlfabric vs TRL's GRPOTrainer, on CPU, in one run.

Same model (a randomly initialised 4-layer, 256-wide Qwen2-style model with the character tokenizer), same batch
(8 prompts x 8 generations x up to 32 new tokens, temperature 1), same reward (the built-in ``arithmetic`` reward,
components weighted correct 1.0 + format 0.1), one optimizer step per GRPO step, no KL term, token-mean loss.

    python benchmarks/grpo_step_vs_trl.py [--steps 10] [--warmup 2] [--threads 2] [--precisions float32 bfloat16]
                                          [--rounds 1]

Each precision runs both frameworks, in turn: ``float32`` (rlfabric's default; TRL with ``bf16=False``, the
anchor) and ``bfloat16`` matmuls with float32 weights (rlfabric's ``learner.matmul_dtype`` and
``generator.matmul_dtype``; TRL's own default ``bf16=True`` mixed precision). Ratios are against the float32 TRL
anchor and against TRL at the same precision. rlfabric also runs once with ``grpo.skip_zero_advantage_rows: false``:
its learner then computes every row, as TRL does, instead of skipping rows whose advantage is 0 (exact: their
gradient is zero). With this randomly initialised model nearly every group's rewards are all 0, so the skip removes
most of the learner's work here; on a task where every group has signal it removes none.

rlfabric's step time is the driver's ``step_time_s`` (generation, reward actors, advantages, learner update and
weight sync to the generator), split into its ``*_time_s`` parts; TRL's is its optimizer step (generation, reward,
loss, backward, update). ``--rounds R`` repeats every contender R times, in turn; each figure is then the median
over the rounds, and each ratio the median of the per-round ratios (the machine's load drifts over minutes, and a
ratio of two runs close in time drifts less than either). Writes benchmarks/results/grpo_step_vs_trl.json.
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


def per_round_ratio(anchor_runs: list[dict], runs: list[dict]) -> list[float]:
    """Anchor seconds / contender seconds, round by round: a pair measured minutes apart shares the machine's
    load at the time, so the ratio is steadier than either time."""
    return [a["seconds_per_step_median"] / r["seconds_per_step_median"] for a, r in zip(anchor_runs, runs, strict=True)]


def summary(runs: list[dict]) -> dict:
    """One contender over the rounds: its runs, and the median of their medians."""
    return {"seconds_per_step_median": statistics.median(r["seconds_per_step_median"] for r in runs), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--precisions", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=1, help="repeat every contender, in turn (medians reported)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be at least 1")

    import torch
    from anchor_trl_grpo import run_trl_grpo

    from rlfabric.envs.text_tasks import arithmetic_rows
    from rlfabric.models.hf import build_small_model_dir
    from rlfabric.rewards import resolve_reward

    torch.set_num_threads(args.threads)
    ours: dict[str, list[dict]] = {}
    trl: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_small_model_dir(Path(tmp) / "model", num_layers=4, hidden_size=256, num_heads=4))
        for round_index in range(1, args.rounds + 1):
            for precision in args.precisions:
                for label, skip in (("", True), (EVERY_ROW, False)):
                    started = time.perf_counter()
                    run = rlfabric_seconds_per_step(
                        model_dir, args.steps, args.warmup, args.threads, args.lr, precision, skip
                    )
                    ours.setdefault(precision + label, []).append(run)
                    median, took = run["seconds_per_step_median"], time.perf_counter() - started
                    print(f"[round {round_index}] rlfabric {precision}{label}: {median:.3f} s/step ({took:.0f}s)")
                run = run_trl_grpo(
                    model_dir,
                    arithmetic_rows(2000, seed=0),
                    resolve_reward("arithmetic"),
                    steps=args.steps,
                    warmup_steps=args.warmup,
                    threads=args.threads,
                    lr=args.lr,
                    reward_weights=WEIGHTS,
                    bf16=precision == "bfloat16",
                    output_dir=str(Path(tmp) / f"trl-{precision}-{round_index}"),
                )
                trl.setdefault(precision, []).append(run)
                print(f"[round {round_index}] TRL      {precision}: {run['seconds_per_step_median']:.3f} s/step")

    anchor_precision = "float32" if "float32" in trl else args.precisions[0]
    anchor_runs = trl[anchor_precision]
    speedups = {}
    rounds = f" (median of {args.rounds} rounds)" if args.rounds > 1 else ""
    print(f"\n{'contender' + rounds:<40}{'s/step':>8}{'vs TRL ' + anchor_precision:>18}{'vs TRL same precision':>24}")
    for name, runs in ours.items():
        precision = name.removesuffix(EVERY_ROW)
        vs_anchor = per_round_ratio(anchor_runs, runs)
        vs_same = per_round_ratio(trl[precision], runs)
        speedups[name] = {
            "vs_trl_anchor": statistics.median(vs_anchor),
            "vs_trl_same_precision": statistics.median(vs_same),
            "vs_trl_anchor_per_round": vs_anchor,
            "vs_trl_same_precision_per_round": vs_same,
        }
        mine = statistics.median(r["seconds_per_step_median"] for r in runs)
        s = speedups[name]
        print(f"{'rlfabric ' + name:<40}{mine:>8.3f}{s['vs_trl_anchor']:>17.2f}x{s['vs_trl_same_precision']:>23.2f}x")
        parts = ", ".join(
            f"{k.removesuffix('_time_s')} {statistics.median(r['parts_median'][k] for r in runs):.3f}" for k in PARTS
        )
        rows = statistics.fmean(r["trained_rows_mean"] for r in runs)
        print(f"    parts (s): {parts}; rows trained per step {rows:.1f} of 64")
        if args.rounds > 1:
            print(f"    vs TRL {anchor_precision} by round: " + ", ".join(f"{x:.2f}x" for x in vs_anchor))
    for precision, runs in trl.items():
        theirs = statistics.median(r["seconds_per_step_median"] for r in runs)
        ratio = statistics.median(per_round_ratio(anchor_runs, runs))
        print(f"{'TRL ' + precision:<40}{theirs:>8.3f}{ratio:>17.2f}x{1.0:>23.2f}x")
    best = max(s["vs_trl_anchor"] for s in speedups.values())
    print(f"rlfabric's best is {best:.2f}x faster per GRPO step than the TRL {anchor_precision} anchor (target 3x)")
    out = {
        "rlfabric": {name: summary(runs) for name, runs in ours.items()},
        "trl": {precision: summary(runs) for precision, runs in trl.items()},
        "speedups": speedups,
        "anchor": f"TRL {anchor_precision}",
        "rounds": args.rounds,
        "threads": args.threads,
        "command": " ".join(["python", "benchmarks/grpo_step_vs_trl.py", *sys.argv[1:]]),
    }
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "grpo_step_vs_trl.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
