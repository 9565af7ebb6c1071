"""Multi-agent PPO throughput on PettingZoo simple_spread_v3: rlfabric against RLlib's multi-agent PPO, in one run.

Settings, the same on both sides: ``simple_spread_v3`` (3 agents, ``max_cycles=25``, ``continuous_actions=False``,
its Parallel API), 2 env runners x N env copies per runner, one shared policy that every agent plays (parameter
sharing), a 64x64 tanh MLP with separate policy and value nets (each critic sees its agent's own observation:
rlfabric's ``multi_agent.critic=independent``, RLlib's default module with ``vf_share_layers=False``), one CPU
learner, the same train batch, epochs and minibatch.

How steps are counted:

* the train batch is counted in **env steps** on both sides: rlfabric's ``ppo.train_batch_size`` is env steps
  (each runner's fragment is ``train_batch / (runners * envs)`` steps of each copy), RLlib's is env steps with
  ``count_steps_by="env_steps"`` (its default; ``rollout_fragment_length="auto"`` splits it the same way). One env
  step of simple_spread is 3 agent steps, so a batch of B env steps gives the shared policy 3B agent steps (rows);
* the minibatch is counted in **agent steps** (rows of the shared policy's batch) on both sides: rlfabric's learner
  cuts the policy's rows into ``ppo.minibatch_size`` rows, RLlib's ``MiniBatchCyclicIterator`` cuts each module's
  batch into ``minibatch_size`` rows;
* every figure reported is env steps per second; the agent steps behind it are in the JSON.

What is measured, each contender in its own process, one after the other:

0. **the step loop**: simple_spread's Parallel env stepped with pre-sampled random actions in a bare loop, one
   process, then ``--num-runners`` processes at once: the simulation limit a runner can approach;
1. **sampling only**: full train batches sampled round after round with the initial (fixed) weights, no learner.
   rlfabric: every runner makes one fragment, the driver waits for all of them (fragments stay in the object store,
   the driver counts steps from their metadata). RLlib: ``synchronous_parallel_sample(max_env_steps=batch)`` on the
   algorithm's env runners, the call its PPO ``training_step`` makes (episodes shipped to the driver, as its PPO
   does). One warm-up round is discarded on both sides.
2. **PPO end to end**: env steps trained per wall-clock second over ``--iters`` iterations after one warm-up
   iteration. rlfabric: ``GameTrainer.train()`` (the times of its metrics rows); RLlib: ``algo.train()`` (its
   ``num_env_steps_sampled_lifetime`` counter, differenced).

Both at 1 env per runner (the easy case: there is nothing to batch across copies, each runner steps one game) and
at ``--envs`` more (default 16 per runner, where batching the copies' agents into one forward pass has work).

Usage::

    pip install -e ".[bench]"
    python benchmarks/multiagent_throughput.py
    # defaults: --envs 1 16 --train-batch 3200 --num-epochs 5 --minibatch 800 --sample-rounds 3 --iters 3

It prints a table of ratios and writes every figure to ``benchmarks/results/multiagent_throughput.json``. One
contender alone: ``--contender rlfabric|rllib --envs 16 --json OUT.json``.
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
from typing import Any

HERE = Path(__file__).resolve().parent
ENV_ID = "simple_spread_v3"
ENV_KWARGS = {"max_cycles": 25, "continuous_actions": False}
HIDDENS = [64, 64]


def log(msg: str) -> None:
    """Print a progress line to stderr."""
    print(f"[multiagent_throughput {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- rlfabric ----------------------------------------------------------------------------------------------------


def rlfabric_overrides(args: argparse.Namespace, envs: int, total_env_steps: int) -> list[str]:
    """The config overrides of rlfabric's side (``load_config(None, overrides)``)."""
    return [
        "algo=ppo",
        f"env.id=mpe2:{ENV_ID}",
        f"env.kwargs={json.dumps(ENV_KWARGS)}",
        "multi_agent.critic=independent",
        f"runners.num_runners={args.num_runners}",
        f"runners.envs_per_runner={envs}",
        f"model.hidden_sizes={json.dumps(HIDDENS)}",
        "model.activation=tanh",
        f"ppo.train_batch_size={args.train_batch}",
        f"ppo.num_epochs={args.num_epochs}",
        f"ppo.minibatch_size={args.minibatch}",
        f"training.total_env_steps={total_env_steps}",
        f"training.seed={args.seed}",
        "training.checkpoint_every=0",
        "training.eval_episodes=0",
    ]


def rlfabric_sampling(trainer: Any, args: argparse.Namespace) -> dict[str, float]:
    """Sampling-only rounds with the initial weights (see the module docstring); one warm-up round."""

    pool = trainer.pool
    env_steps = agent_steps = 0
    seconds = 0.0
    for round_index in range(args.sample_rounds + 1):
        start = time.perf_counter()
        done = pool.sample_round()
        elapsed = time.perf_counter() - start
        n = sum(c.meta["env_steps"] for c in done)
        if round_index > 0:  # round 0 warms up
            env_steps += n
            agent_steps += sum(sum(c.meta["agent_steps"].values()) for c in done)
            seconds += elapsed
        log(f"rlfabric sampling round {round_index}: {n} env steps in {elapsed:.2f} s")
    return {
        "sampling_steps_per_s": env_steps / seconds,
        "sampling_env_steps": env_steps,
        "sampling_agent_steps": agent_steps,
        "sampling_seconds": seconds,
    }


def rlfabric_training(trainer: Any) -> dict[str, float]:
    """``GameTrainer.train()`` for 1 + iters iterations; env steps/s over the iterations after the first (the
    times of its metrics rows)."""
    trainer.train()
    rows = [json.loads(line) for line in (Path(trainer.run_dir) / "metrics.jsonl").read_text().splitlines()]
    seconds = rows[-1]["time_total_s"] - rows[0]["time_total_s"]
    env_steps = rows[-1]["env_steps"] - rows[0]["env_steps"]
    log(f"rlfabric training: warm-up {rows[0]['time_total_s']:.2f} s, then {env_steps} env steps in {seconds:.2f} s")
    return {
        "train_steps_per_s": env_steps / seconds,
        "train_env_steps": env_steps,
        "train_agent_steps": sum(r["agent_steps"] for r in rows[1:]),
        "train_seconds": seconds,
        "warmup_iteration_s": rows[0]["time_total_s"],
        # per timed iteration: a runner's time to make its fragment, the learner's update
        "sample_time_s_mean": sum(r["sample_time_s"] for r in rows[1:]) / len(rows[1:]),
        "learn_time_s_mean": sum(r["learn_time_s"] for r in rows[1:]) / len(rows[1:]),
    }


def run_rlfabric(args: argparse.Namespace, envs: int) -> dict[str, Any]:
    """Sampling only, then PPO end to end, on one ``GameTrainer`` (its runners and learner started once, as
    RLlib's side uses one algorithm for both)."""
    from rlfabric.config import load_config
    from rlfabric.game_driver import GameTrainer

    overrides = rlfabric_overrides(args, envs, args.train_batch * (args.iters + 1))
    trainer = GameTrainer(load_config(None, overrides), tempfile.mkdtemp(prefix="rlfabric-bench-"), quiet=True)
    try:
        trainer.setup()
        result: dict[str, Any] = {**rlfabric_sampling(trainer, args), **rlfabric_training(trainer)}
    finally:
        trainer.close()
    result["overrides"] = overrides
    return result


# -- RLlib -------------------------------------------------------------------------------------------------------


def rllib_config(args: argparse.Namespace, envs: int) -> Any:
    """RLlib PPO (new API stack), multi-agent: one module "shared" that every agent maps to."""
    from mpe2 import simple_spread_v3
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
    from ray.rllib.core.rl_module.multi_rl_module import MultiRLModuleSpec
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec
    from ray.rllib.env.wrappers.pettingzoo_env import ParallelPettingZooEnv
    from ray.tune.registry import register_env

    register_env(ENV_ID, lambda _: ParallelPettingZooEnv(simple_spread_v3.parallel_env(**ENV_KWARGS)))
    return (
        PPOConfig()
        .environment(ENV_ID)
        .framework("torch")
        .env_runners(
            num_env_runners=args.num_runners,
            num_envs_per_env_runner=envs,
            num_cpus_per_env_runner=1,
            rollout_fragment_length="auto",
        )
        .multi_agent(
            policies={"shared"},
            policy_mapping_fn=lambda agent_id, episode, **kwargs: "shared",
            count_steps_by="env_steps",
        )
        .rl_module(
            rl_module_spec=MultiRLModuleSpec(rl_module_specs={"shared": RLModuleSpec()}),
            model_config=DefaultModelConfig(fcnet_hiddens=HIDDENS, fcnet_activation="tanh", vf_share_layers=False),
        )
        .learners(num_learners=0, num_gpus_per_learner=0)
        .training(
            train_batch_size_per_learner=args.train_batch,
            num_epochs=args.num_epochs,
            minibatch_size=args.minibatch,
        )
        .debugging(seed=args.seed, log_level="WARN")
    )


def _rllib_sample_round(algo: Any, train_batch: int) -> tuple[int, int]:
    """One PPO-style collection round without learning; returns (env steps, agent steps) returned."""
    from anchor_rllib import sample_episodes

    episodes = sample_episodes(algo, train_batch)
    return sum(ep.env_steps() for ep in episodes), sum(ep.agent_steps() for ep in episodes)


def rllib_sampling(algo: Any, args: argparse.Namespace) -> dict[str, float]:
    """Sampling-only rounds with the algorithm's initial weights; one warm-up round."""
    env_steps = agent_steps = 0
    seconds = 0.0
    for round_index in range(args.sample_rounds + 1):
        start = time.perf_counter()
        n, m = _rllib_sample_round(algo, args.train_batch)
        elapsed = time.perf_counter() - start
        if round_index > 0:
            env_steps, agent_steps, seconds = env_steps + n, agent_steps + m, seconds + elapsed
        log(f"rllib sampling round {round_index}: {n} env steps ({m} agent steps) in {elapsed:.2f} s")
    return {
        "sampling_steps_per_s": env_steps / seconds,
        "sampling_env_steps": env_steps,
        "sampling_agent_steps": agent_steps,
        "sampling_seconds": seconds,
    }


def rllib_training(algo: Any, args: argparse.Namespace) -> dict[str, float]:
    """``algo.train()`` for 1 + iters iterations; env steps/s over the iterations after the first."""
    from ray.rllib.utils.metrics import (
        ENV_RUNNER_RESULTS,
        ENV_RUNNER_SAMPLING_TIMER,
        LEARNER_UPDATE_TIMER,
        NUM_AGENT_STEPS_SAMPLED_LIFETIME,
        NUM_ENV_STEPS_SAMPLED_LIFETIME,
        TIMERS,
    )

    def lifetime(result: dict[str, Any]) -> tuple[int, int]:
        r = result[ENV_RUNNER_RESULTS]
        agents = r[NUM_AGENT_STEPS_SAMPLED_LIFETIME]
        return int(r[NUM_ENV_STEPS_SAMPLED_LIFETIME]), int(sum(agents.values()) if isinstance(agents, dict) else agents)

    start = time.perf_counter()
    env0, agent0 = lifetime(algo.train())
    warmup = time.perf_counter() - start
    t0 = time.perf_counter()
    env1, agent1 = env0, agent0
    timers: dict[str, list[float]] = {"sample": [], "learn": []}
    for i in range(args.iters):
        ti = time.perf_counter()
        result = algo.train()
        env1, agent1 = lifetime(result)
        timers["sample"].append(float(result[TIMERS][ENV_RUNNER_SAMPLING_TIMER]))
        timers["learn"].append(float(result[TIMERS][LEARNER_UPDATE_TIMER]))
        log(f"rllib train iter {i + 1}/{args.iters}: {time.perf_counter() - ti:.2f} s, lifetime env steps {env1}")
    seconds = time.perf_counter() - t0
    log(f"rllib training: warm-up {warmup:.2f} s, then {env1 - env0} env steps in {seconds:.2f} s")
    return {
        "train_steps_per_s": (env1 - env0) / seconds,
        "train_env_steps": env1 - env0,
        "train_agent_steps": agent1 - agent0,
        "train_seconds": seconds,
        "warmup_iteration_s": warmup,
        # RLlib's own timers of the sampling call and the learner update, as its result reports them: an exponential
        # moving average (coefficient 0.01) that starts at the warm-up iteration, so mostly that iteration's times
        "sample_time_s_mean": sum(timers["sample"]) / len(timers["sample"]),
        "learn_time_s_mean": sum(timers["learn"]) / len(timers["learn"]),
    }


def run_rllib(args: argparse.Namespace, envs: int) -> dict[str, Any]:
    """Sampling only, then PPO end to end, on one RLlib algorithm."""
    import ray

    config = rllib_config(args, envs)
    algo = config.build_algo()
    try:
        module = algo.get_module("shared")
        result: dict[str, Any] = {
            **rllib_sampling(algo, args),
            **rllib_training(algo, args),
            "ray_version": ray.__version__,
            "module": type(module).__name__,
            "parameters": sum(p.numel() for p in module.parameters()),
            "rollout_fragment_length": config.get_rollout_fragment_length(1),
        }
    finally:
        algo.stop()
    return result


# -- the simulation limit ----------------------------------------------------------------------------------------


def _env_loop(steps: int, seed: int) -> float:
    """``steps`` env steps of simple_spread's Parallel env with pre-sampled random actions, reset at episode end
    (after 200 untimed steps); returns the timed seconds."""
    import numpy as np
    from mpe2 import simple_spread_v3

    env = simple_spread_v3.parallel_env(**ENV_KWARGS)
    env.reset(seed=seed)
    agents = list(env.possible_agents)
    pool = np.random.default_rng(seed).integers(0, 5, (1000, len(agents)))
    actions = [dict(zip(agents, (int(a) for a in row), strict=True)) for row in pool]

    def run(n: int) -> None:
        for i in range(n):
            env.step(actions[i % len(actions)])
            if not env.agents:
                env.reset()

    run(200)
    env.reset()
    start = time.perf_counter()
    run(steps)
    seconds = time.perf_counter() - start
    env.close()
    return seconds


def _env_loop_worker(steps: int, seed: int, ready: Any, go: Any, out: Any) -> None:
    import numpy as np  # noqa: F401  (imported before the barrier, not timed)
    from mpe2 import simple_spread_v3  # noqa: F401

    ready.release()
    go.wait()
    out.put(_env_loop(steps, seed))


def run_env_loop(args: argparse.Namespace) -> dict[str, Any]:
    """The simulation limit: a bare step loop in one process, then in ``--num-runners`` processes at once (total
    steps over the wall time from a common start until the last one ends)."""
    import multiprocessing as mp

    steps = args.loop_steps
    single = steps / _env_loop(steps, args.seed)
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_env_loop_worker, args=(steps, args.seed + 1 + k, ready, go, out))
        for k in range(args.num_runners)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.acquire()
    start = time.perf_counter()
    go.set()
    seconds = [out.get() for _ in procs]
    wall = time.perf_counter() - start
    for proc in procs:
        proc.join()
    log(f"env loop: {single:.0f} env steps/s in one process, {steps * len(procs) / wall:.0f} in {len(procs)}")
    return {
        "single_process_steps_per_s": single,
        "parallel_steps_per_s": steps * len(procs) / wall,
        "parallel_processes": len(procs),
        "parallel_process_seconds": seconds,
        "steps_per_process": steps,
    }


# -- one contender (a child process) -----------------------------------------------------------------------------


def run_contender(args: argparse.Namespace) -> None:
    import ray

    if args.contender == "loop":
        result = run_env_loop(args)
        print(json.dumps(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return
    envs = args.envs[0]
    ray.init(num_cpus=max(4, args.num_runners + 2), include_dashboard=False, log_to_driver=False)
    try:
        result = run_rlfabric(args, envs) if args.contender == "rlfabric" else run_rllib(args, envs)
    finally:
        ray.shutdown()
    result.update(framework=args.contender, envs_per_runner=envs)
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


# -- the whole benchmark -----------------------------------------------------------------------------------------


def child(args: argparse.Namespace, contender: str, envs: int) -> dict[str, Any]:
    """Run one contender in a fresh process and return the JSON it writes."""
    out = Path(tempfile.mkdtemp(prefix="rlfabric-bench-")) / "result.json"
    settings = {
        "--contender": contender,
        "--envs": envs,
        "--num-runners": args.num_runners,
        "--train-batch": args.train_batch,
        "--num-epochs": args.num_epochs,
        "--minibatch": args.minibatch,
        "--sample-rounds": args.sample_rounds,
        "--iters": args.iters,
        "--loop-steps": args.loop_steps,
        "--seed": args.seed,
        "--json": out,
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), *(str(x) for kv in settings.items() for x in kv)]
    log(f"$ {' '.join(cmd[1:])}")
    start, load_before = time.monotonic(), os.getloadavg()[0]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    load_after = os.getloadavg()[0]
    log(f"done in {time.monotonic() - start:.0f} s (1-minute load average {load_before:.1f} -> {load_after:.1f})")
    return {
        **json.loads(out.read_text()),
        "wall_s": time.monotonic() - start,
        "load_average_1min": [load_before, load_after],
    }


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}x"


def table(loop: dict[str, Any], cases: list[dict[str, Any]], num_runners: int) -> str:
    """The results as a markdown table. The last column compares one runner's sampling rate with the bare step loop
    in one process (the per-process simulation limit): the share of a runner's time spent stepping the env."""
    limit = loop["single_process_steps_per_s"]
    lines = [
        "| envs per runner | measure | RLlib env steps/s | rlfabric env steps/s | **rlfabric / RLlib** "
        "| per runner / 1-process step loop, RLlib vs rlfabric |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for case in cases:
        fabric, rllib = case["rlfabric"], case["rllib"]
        for key, name in (("sampling_steps_per_s", "sampling only"), ("train_steps_per_s", "PPO end to end")):
            theirs = rllib and rllib[key]
            shown = "n/a" if theirs is None else f"{theirs:,.0f}"
            share = ""
            if key == "sampling_steps_per_s":
                mine = f"{fabric[key] / num_runners / limit:.2f}"
                share = f"{'n/a' if theirs is None else f'{theirs / num_runners / limit:.2f}'} vs {mine}"
            lines.append(
                f"| {case['envs_per_runner']} | {name} | {shown} | {fabric[key]:,.0f} | "
                f"**{ratio(fabric[key], theirs)}** | {share} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", type=int, nargs="+", default=[1, 16], help="env copies per runner, one case each")
    p.add_argument("--num-runners", type=int, default=2)
    p.add_argument("--train-batch", type=int, default=3200, help="env steps per PPO iteration")
    p.add_argument("--num-epochs", type=int, default=5)
    p.add_argument("--minibatch", type=int, default=800, help="agent steps (rows of the shared policy)")
    p.add_argument("--sample-rounds", type=int, default=3, help="timed sampling-only rounds")
    p.add_argument("--iters", type=int, default=3, help="timed PPO iterations")
    p.add_argument("--loop-steps", type=int, default=4000, help="timed steps per process of the simulation limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-rllib", action="store_true", help="omit the RLlib anchor (no `bench` extra)")
    p.add_argument("--contender", choices=["rlfabric", "rllib", "loop"], default=None, help="run one, here")
    p.add_argument("--json", default=None, help="with --contender: write its figures here")
    p.add_argument("--out", default=str(HERE / "results" / "multiagent_throughput.json"))
    args = p.parse_args(argv)
    for envs in args.envs:
        if args.train_batch % (args.num_runners * envs):
            p.error(
                f"--train-batch {args.train_batch} must be a multiple of runners x envs ({args.num_runners * envs})"
            )
    if args.contender is not None:
        if len(args.envs) != 1:
            p.error("--contender runs one case: give one --envs value")
        run_contender(args)
        return

    start = time.monotonic()
    loop = child(args, "loop", args.envs[0])
    cases = []
    for envs in args.envs:
        fabric = child(args, "rlfabric", envs)
        rllib = None if args.skip_rllib else child(args, "rllib", envs)
        cases.append({"envs_per_runner": envs, "rlfabric": fabric, "rllib": rllib})
    print(
        f"\nsimulation limit: {loop['single_process_steps_per_s']:,.0f} env steps/s in one process, "
        f"{loop['parallel_steps_per_s']:,.0f} in {loop['parallel_processes']}\n"
    )
    print(table(loop, cases, args.num_runners))

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python", "benchmarks/multiagent_throughput.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "settings": {
            "env": f"{ENV_ID} {ENV_KWARGS} (3 agents, Parallel API)",
            "num_runners": args.num_runners,
            "train_batch_env_steps": args.train_batch,
            "num_epochs": args.num_epochs,
            "minibatch_agent_steps": args.minibatch,
            "model": f"{HIDDENS} tanh, separate policy and value nets, one shared policy",
            "sample_rounds": args.sample_rounds,
            "train_iters": args.iters,
            "warmup": "1 sampling round + 1 train iteration, not timed",
        },
        "simulation_limit": loop,
        "cases": cases,
        "total_wall_s": time.monotonic() - start,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {args.out} ({result['total_wall_s']:.0f} s in all)")


if __name__ == "__main__":
    main()
