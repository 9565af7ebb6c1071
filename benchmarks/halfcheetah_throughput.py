"""HalfCheetah-v5 PPO throughput, rlfabric side by side with its anchors, in one run.

Settings (the foundation issue's): 2 runners x 4 envs, train batch 4000, 10 epochs, minibatch 128, 64x64 MLP.
Each contender runs in its own process, one after the other, on the same machine:

1. the simulation limit: a plain gymnasium step loop, one process and ``os.cpu_count()`` processes;
2. rlfabric: sampling-only, then end-to-end training (sync, ``max_policy_lag=0``), then async (lag 1);
3. RLlib's PPO (new API stack): sampling-only and end-to-end training.

It prints a table of ratios and writes every figure to ``benchmarks/results/halfcheetah_throughput.json``.
RLlib needs the ``bench`` extra: ``pip install -e ".[bench]"``.

Usage::

    python benchmarks/halfcheetah_throughput.py [--skip-rllib]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_json(script: str, *args: str) -> dict:
    """Run one benchmark script in a fresh process and return the JSON it writes."""
    out = Path(tempfile.mkdtemp(prefix="rlfabric-bench-")) / "result.json"
    cmd = [sys.executable, str(HERE / script), *args, "--json", str(out)]
    print(f"$ {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    start = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    print(f"  done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return json.loads(out.read_text())


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}x"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-rllib", action="store_true", help="omit the RLlib anchor (no `bench` extra)")
    p.add_argument("--out", default=str(HERE / "results" / "halfcheetah_throughput.json"))
    args = p.parse_args()

    procs = os.cpu_count() or 1
    gym_loop = run_json("anchor_gym_loop.py", "--env", "HalfCheetah-v5", "--procs", str(procs))
    sync = run_json("rlfabric_throughput.py", "--env", "gym:HalfCheetah-v5", "--max-policy-lag", "0")
    async_ = run_json("rlfabric_throughput.py", "--mode", "training", "--max-policy-lag", "1")
    rllib = None if args.skip_rllib else run_json("anchor_rllib.py", "--env", "HalfCheetah-v5")

    limit = gym_loop["parallel_steps_per_s"]
    rl_sample = rllib and rllib["sampling_steps_per_s"]
    rl_train = rllib and rllib["train_steps_per_s"]
    rows = [
        ("gymnasium step loop, 1 process", gym_loop["single_process_steps_per_s"], "", ""),
        (f"gymnasium step loop, {procs} processes (limit)", limit, "", "1.00"),
        ("RLlib PPO sampling-only", rl_sample, "1.00x", ratio(rl_sample, limit)),
        ("rlfabric sampling-only", sync["sampling_steps_per_s"], ratio(sync["sampling_steps_per_s"], rl_sample),
         ratio(sync["sampling_steps_per_s"], limit)),
        ("RLlib PPO training", rl_train, "1.00x", ""),
        ("rlfabric training, sync (lag 0)", sync["train_steps_per_s"], ratio(sync["train_steps_per_s"], rl_train), ""),
        ("rlfabric training, async (lag 1)", async_["train_steps_per_s"],
         ratio(async_["train_steps_per_s"], rl_train), ""),
    ]  # fmt: skip
    print("\n| contender | env steps/s | vs RLlib | share of the simulation limit |")
    print("| --- | ---: | ---: | ---: |")
    for name, value, vs_rllib, vs_limit in rows:
        shown = "n/a" if value is None else f"{value:,.0f}"
        print(f"| {name} | {shown} | {vs_rllib} | {vs_limit.replace('x', '') if vs_limit else ''} |")

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": procs, "platform": platform.platform(), "python": platform.python_version()},
        "gym_loop": gym_loop,
        "rlfabric_sync": sync,
        "rlfabric_async": async_,
        "rllib": rllib,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
