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
most of the learner's work here; on a task where every group has signal it removes none. And once with
``learner.sequence_packing: padded``: one padded row per completion, TRL's layout, instead of each prompt once with
its completions behind it (``rlfabric.models.prefix_packing``).

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
PADDED = ", padded rows"  # learner.sequence_packing: padded (TRL's layout)
# rlfabric's contenders: (label suffix, grpo.skip_zero_advantage_rows, learner.sequence_packing)
VARIANTS = (("", True, "shared_prefix"), (EVERY_ROW, False, "shared_prefix"), (PADDED, True, "padded"))
# The step's parts as the driver times them; batch_time_s and compute_time_s are the learner's own share of update.
PARTS = ("generate_time_s", "reward_time_s", "update_time_s", "batch_time_s", "compute_time_s", "weight_sync_time_s")


def rlfabric_seconds_per_step(
    model_dir: str,
    steps: int,
    warmup: int,
    threads: int,
    lr: float,
    matmul_dtype: str = "float32",
    skip_zero_advantage_rows: bool = True,
    sequence_packing: str = "shared_prefix",
) -> dict:
    import ray

    from rlfabric.config import config_from_dict
    from rlfabric.llm_driver import train_llm
    from rlfabric.run.log import read_metrics

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
            "learner": {"matmul_dtype": matmul_dtype, "sequence_packing": sequence_packing},
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
        "reward_mean": statistics.fmean(r["reward_mean"] for r in rows),
        "driver_received_bytes_median": statistics.median(r["driver_received_bytes"] for r in rows),
        "trajectory_bytes_median": statistics.median(r["trajectory_bytes"] for r in rows),
        "update_flops_median": statistics.median(training_flops(model_dir, r) for r in rows),
        "update_seconds_per_row_median": statistics.median(r["update_time_s"] / r["trained_rows"] for r in rows),
        "steps": len(times),
        "samples_per_step": 64,
    }


def training_flops(model_dir: str, row: dict) -> float:
    """FLOPs of one learner update as run (padding included): forward 2 x (body parameters) per position plus
    2 x hidden x vocab per LM-head position plus attention 4 x layers x hidden x (positions per input row) per
    position (the mask hides keys but the kernel computes every score); backward twice the forward."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = h // heads
    attn_params = h * h * 2 + 2 * h * kv_heads * head_dim  # q and o, k and v
    mlp_params = 3 * h * config["intermediate_size"]
    body = layers * (attn_params + mlp_params)
    positions, responses, rows = row["trained_positions"], row["trained_head_positions"], row["trained_sequences"]
    width = positions / max(rows, 1)
    forward = 2 * body * positions + 2 * h * vocab * responses + 4 * layers * h * width * positions
    return 3.0 * forward


def sgemm_peak_flops(threads: int, dtype: str = "float32") -> float:
    """The machine's matmul peak as torch reaches it: best of 5 timed 1024 x 1024 x 1024 products."""
    import torch

    torch.set_num_threads(threads)
    kind = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    a, b = torch.randn(1024, 1024, dtype=kind), torch.randn(1024, 1024, dtype=kind)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - started) / 4)
    return 2 * 1024**3 / best


def warm_start_model(model_dir: str, out_dir: Path, steps: int, seed: int = 0) -> str:
    """The benchmark model after ``steps`` supervised steps on the unreliable arithmetic teacher (the quickstart's
    warm-up): it now answers some prompts right and some wrong, so GRPO groups have reward spread and the learner
    trains on most rows."""
    import dataclasses
    import random

    from rlfabric.actors.llm_learner import LLMLearnerCore
    from rlfabric.envs.text_tasks import arithmetic_rows
    from rlfabric.grpo_config import GRPOConfig
    from rlfabric.models.packed_batch import pack_sequences

    learner = LLMLearnerCore(
        model_dir,
        {**dataclasses.asdict(GRPOConfig()), "norm_length": 32},
        {"lr": 1e-3},
        temperature=1.0,
        seed=seed,
    )
    tok = learner.tokenizer
    rows = arithmetic_rows(2000, seed=seed, teacher_error=0.6)
    rng = random.Random(seed)
    for _ in range(steps):
        batch = rng.sample(rows, 64)
        prompts = [tok(r["prompt"], add_special_tokens=False).input_ids for r in batch]
        answers = [
            tok(rng.choice(r["teacher"]), add_special_tokens=False).input_ids + [tok.eos_token_id] for r in batch
        ]
        learner.sft_step(pack_sequences(prompts, answers, tok.pad_token_id))
    return learner.save(str(out_dir), with_optimizer=False)


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
    parser.add_argument(
        "--starts",
        nargs="+",
        default=["random", "sft"],
        choices=["random", "sft"],
        help="random: the untrained model (most groups without signal); sft: after a supervised warm-up",
    )
    parser.add_argument("--sft-steps", type=int, default=300, help="supervised steps of the 'sft' start")
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
    peaks = {precision: sgemm_peak_flops(args.threads, precision) for precision in args.precisions}
    print("matmul peak: " + ", ".join(f"{p} {f / 1e9:.0f} GFLOP/s" for p, f in peaks.items()))
    ours: dict[str, list[dict]] = {}
    trl: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        random_dir = str(build_small_model_dir(Path(tmp) / "model", num_layers=4, hidden_size=256, num_heads=4))
        models = {"random": random_dir}
        if "sft" in args.starts:
            started = time.perf_counter()
            models["sft"] = warm_start_model(random_dir, Path(tmp) / "sft_model", args.sft_steps)
            print(f"sft start: {args.sft_steps} supervised steps ({time.perf_counter() - started:.0f}s)")
        for round_index in range(1, args.rounds + 1):
            for start in args.starts:
                for precision in args.precisions:
                    key = f"{start} {precision}"
                    for label, skip, packing in VARIANTS:
                        started = time.perf_counter()
                        run = rlfabric_seconds_per_step(
                            models[start], args.steps, args.warmup, args.threads, args.lr, precision, skip, packing
                        )
                        ours.setdefault(key + label, []).append(run)
                        median, took = run["seconds_per_step_median"], time.perf_counter() - started
                        print(f"[round {round_index}] rlfabric {key}{label}: {median:.3f} s/step ({took:.0f}s)")
                    run = run_trl_grpo(
                        models[start],
                        arithmetic_rows(2000, seed=0),
                        resolve_reward("arithmetic"),
                        steps=args.steps,
                        warmup_steps=args.warmup,
                        threads=args.threads,
                        lr=args.lr,
                        reward_weights=WEIGHTS,
                        bf16=precision == "bfloat16",
                        output_dir=str(Path(tmp) / f"trl-{start}-{precision}-{round_index}"),
                    )
                    trl.setdefault(key, []).append(run)
                    print(f"[round {round_index}] TRL      {key}: {run['seconds_per_step_median']:.3f} s/step")

    speedups = {}
    rounds = f" (median of {args.rounds} rounds)" if args.rounds > 1 else ""
    for start in args.starts:
        anchor_key = f"{start} float32" if "float32" in args.precisions else f"{start} {args.precisions[0]}"
        anchor_runs = trl[anchor_key]
        print(f"\n== start: {start} ==")
        print(f"{'contender' + rounds:<44}{'s/step':>8}{'vs TRL ' + anchor_key:>22}{'vs TRL same precision':>24}")
        for name, runs in ours.items():
            if not name.startswith(start + " "):
                continue
            same = name.removesuffix(EVERY_ROW).removesuffix(PADDED)
            vs_anchor, vs_same = per_round_ratio(anchor_runs, runs), per_round_ratio(trl[same], runs)
            mine = statistics.median(r["seconds_per_step_median"] for r in runs)
            trl_update_per_row = statistics.median(r["update_seconds_median"] / 64 for r in trl[same])
            update_per_row = statistics.median(r["update_seconds_per_row_median"] for r in runs)
            update_s = statistics.median(r["parts_median"]["update_time_s"] for r in runs)
            compute_s = statistics.median(r["parts_median"]["compute_time_s"] for r in runs)
            flops = statistics.median(r["update_flops_median"] for r in runs)
            precision = same.split(" ")[1]
            speedups[name] = {
                "vs_trl_anchor": statistics.median(vs_anchor),
                "vs_trl_same_precision": statistics.median(vs_same),
                "vs_trl_anchor_per_round": vs_anchor,
                "vs_trl_same_precision_per_round": vs_same,
                "update_per_row_vs_trl_training_per_row": trl_update_per_row / update_per_row,
                # In the learner's forward, backward and optimizer (compute_time_s) ...
                "learner_gflops_per_s": flops / compute_s / 1e9,
                "learner_fraction_of_matmul_peak": flops / compute_s / peaks[precision],
                # ... and over the whole update call as the driver waits for it (Ray call, records, batch).
                "update_gflops_per_s_as_driver_waits": flops / update_s / 1e9,
                "driver_bytes_fraction": statistics.median(
                    r["driver_received_bytes_median"] / r["trajectory_bytes_median"] for r in runs
                ),
            }
            sp = speedups[name]
            ratios = f"{sp['vs_trl_anchor']:>21.2f}x{sp['vs_trl_same_precision']:>23.2f}x"
            print(f"{'rlfabric ' + name:<44}{mine:>8.3f}{ratios}")
            parts = ", ".join(
                f"{k.removesuffix('_time_s')} {statistics.median(r['parts_median'][k] for r in runs):.3f}"
                for k in PARTS
            )
            rows = statistics.fmean(r["trained_rows_mean"] for r in runs)
            print(f"    parts (s): {parts}; rows trained per step {rows:.1f} of 64")
            print(
                f"    update per row {update_per_row * 1e3:.2f} ms vs TRL's training part per row "
                f"{trl_update_per_row * 1e3:.2f} ms: {sp['update_per_row_vs_trl_training_per_row']:.2f}x; learner "
                f"{sp['learner_gflops_per_s']:.0f} GFLOP/s = {100 * sp['learner_fraction_of_matmul_peak']:.0f}% of "
                f"the {precision} matmul peak ({sp['update_gflops_per_s_as_driver_waits']:.0f} GFLOP/s over the "
                "whole update call)"
            )
            print(
                f"    driver received {statistics.median(r['driver_received_bytes_median'] for r in runs):.0f} B/step "
                f"for {statistics.median(r['trajectory_bytes_median'] for r in runs):.0f} B of trajectories: "
                f"{100 * sp['driver_bytes_fraction']:.2f}%"
            )
            if args.rounds > 1:
                print(f"    vs TRL {anchor_key} by round: " + ", ".join(f"{x:.2f}x" for x in vs_anchor))
        for key, runs in trl.items():
            if key.startswith(start + " "):
                theirs = statistics.median(r["seconds_per_step_median"] for r in runs)
                ratio = statistics.median(per_round_ratio(anchor_runs, runs))
                print(f"{'TRL ' + key:<44}{theirs:>8.3f}{ratio:>21.2f}x{1.0:>23.2f}x")
    out = {
        "rlfabric": {name: summary(runs) for name, runs in ours.items()},
        "trl": {key: summary(runs) for key, runs in trl.items()},
        "speedups": speedups,
        "matmul_peak_flops": peaks,
        "rounds": args.rounds,
        "threads": args.threads,
        "command": " ".join(["python", "benchmarks/grpo_step_vs_trl.py", *sys.argv[1:]]),
    }
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "grpo_step_vs_trl.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
