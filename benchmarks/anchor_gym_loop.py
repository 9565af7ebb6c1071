"""Anchor benchmark: the simulation limit of a plain gymnasium step loop.

What is measured: env steps per second of ``env.step(action)`` in a bare Python
loop with random actions, no policy, no framework, no vectorisation wrapper:

* ``single_process_steps_per_s`` -- one process doing ``--steps`` steps;
* ``parallel_steps_per_s`` -- ``--procs`` processes (multiprocessing, spawn) each
  doing the same ``--steps``-step loop at the same time; aggregate rate is the
  total steps of all processes divided by the wall time from a common start
  barrier until the last one finishes.

Actions are pre-sampled from ``env.action_space`` (a pool of ``--action-pool``
actions, cycled) so the timed loop is ``env.step`` plus the reset on
``terminated or truncated`` only. Each process does an untimed warm-up of
``--warmup`` steps first. ``torch`` is never imported.

Why: it is the upper bound that any RL framework's sampling throughput
(rlfabric's, RLlib's) on this machine can approach; the ratio framework/limit
shows how much is framework overhead versus physics simulation.

Usage::

    python benchmarks/anchor_gym_loop.py --env HalfCheetah-v5 --steps 50000 --procs 2 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from typing import Any

import gymnasium as gym
import numpy as np


def log(msg: str) -> None:
    """Print a progress line to stderr."""
    print(f"[anchor_gym_loop {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="HalfCheetah-v5")
    p.add_argument("--steps", type=int, default=50_000, help="timed steps per process")
    p.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--warmup", type=int, default=1_000, help="untimed steps per process")
    p.add_argument("--action-pool", type=int, default=10_000, help="pre-sampled actions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results to this JSON file")
    return p.parse_args(argv)


def _prepare(env_id: str, warmup: int, pool: int, seed: int) -> tuple[gym.Env, list[Any]]:
    """Make and seed the env, pre-sample actions, run the untimed warm-up, reset."""
    env = gym.make(env_id)
    env.reset(seed=seed)
    env.action_space.seed(seed)
    actions = [env.action_space.sample() for _ in range(max(1, pool))]
    _timed_loop(env, actions, warmup)
    env.reset()
    return env, actions


def _timed_loop(env: gym.Env, actions: list[Any], steps: int) -> tuple[float, int]:
    """The measured loop: step with random actions, reset on episode end."""
    n_act = len(actions)
    resets = 0
    t0 = time.perf_counter()
    for i in range(steps):
        _, _, term, trunc, _ = env.step(actions[i % n_act])
        if term or trunc:
            env.reset()
            resets += 1
    return time.perf_counter() - t0, resets


def step_loop(env_id: str, steps: int, warmup: int, pool: int, seed: int) -> tuple[int, float, int]:
    """Single process: warm up, then ``steps`` timed steps; return (steps, seconds, resets)."""
    env, actions = _prepare(env_id, warmup, pool, seed)
    dt, resets = _timed_loop(env, actions, steps)
    env.close()
    return steps, dt, resets


def _worker(
    env_id: str,
    steps: int,
    warmup: int,
    pool: int,
    seed: int,
    ready: Any,
    go: Any,
    out: Any,
) -> None:
    """Child process: build env + warm up, wait at the start barrier, run, report."""
    env, actions = _prepare(env_id, warmup, pool, seed)
    ready.release()
    go.wait()
    dt, _ = _timed_loop(env, actions, steps)
    env.close()
    out.put((seed, steps, dt))


def run_parallel(env_id: str, steps: int, warmup: int, pool: int, seed: int, procs: int) -> dict[str, Any]:
    """Run ``procs`` step loops concurrently; aggregate rate over common wall time."""
    ctx = mp.get_context("spawn")
    ready = ctx.Semaphore(0)
    go = ctx.Event()
    out = ctx.Queue()
    ps = [
        ctx.Process(target=_worker, args=(env_id, steps, warmup, pool, seed + 1 + k, ready, go, out))
        for k in range(procs)
    ]
    for p in ps:
        p.start()
    for _ in range(procs):
        ready.acquire()
    t0 = time.perf_counter()
    go.set()
    results = [out.get() for _ in range(procs)]
    wall = time.perf_counter() - t0
    for p in ps:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"worker exited with code {p.exitcode}")
    total = sum(r[1] for r in results)
    return {
        "parallel_steps_per_s": total / wall,
        "parallel_total_steps": total,
        "parallel_wall_s": wall,
        "per_process_steps_per_s": sorted(r[1] / r[2] for r in results),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run both measurements, print a summary line and optionally write JSON."""
    args = parse_args(argv)
    log(f"single process: {args.steps} steps of {args.env}")
    steps, dt, resets = step_loop(args.env, args.steps, args.warmup, args.action_pool, args.seed)
    single = steps / dt
    log(f"single process: {single:.0f} steps/s ({dt:.2f}s, {resets} resets)")
    log(f"parallel: {args.procs} processes x {args.steps} steps")
    par = run_parallel(args.env, args.steps, args.warmup, args.action_pool, args.seed, args.procs)
    log(f"parallel: {par['parallel_steps_per_s']:.0f} steps/s aggregate ({par['parallel_wall_s']:.2f}s)")
    out: dict[str, Any] = {
        "framework": "gymnasium-loop",
        "single_process_steps_per_s": single,
        "parallel_steps_per_s": par["parallel_steps_per_s"],
        "procs": args.procs,
        "details": {
            "single_process_steps": steps,
            "single_process_seconds": dt,
            "single_process_resets": resets,
            **par,
        },
        "settings": {
            "env": args.env,
            "steps_per_process": args.steps,
            "warmup_steps_per_process": args.warmup,
            "action_pool": args.action_pool,
            "seed": args.seed,
            "start_method": "spawn",
            "gymnasium_version": gym.__version__,
            "numpy_version": np.__version__,
            "python": platform.python_version(),
            "os_cpu_count": os.cpu_count(),
        },
    }
    print(
        f"gymnasium {gym.__version__} {args.env} random-action loop: single process "
        f"{single:.0f} steps/s, {args.procs} processes {par['parallel_steps_per_s']:.0f} steps/s aggregate"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        log(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
