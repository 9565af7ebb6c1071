"""Faults in GRPO runs, each survived with no sample lost or duplicated, or stopped with one clear line.

Real actors on a real local Ray instance: generators and learners are killed with SIGKILL, reward functions hang
or raise. The reward functions live in this file and reach the reward services through the registry snapshot.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
from grpo_runs import BASE, TINY, merged, run_grpo, write_prompts

from rlfabric.actor_slots import error_kind
from rlfabric.agents import register_agent
from rlfabric.config import ConfigError, config_from_dict
from rlfabric.llm_driver import GRPOTrainer
from rlfabric.registry import register_env
from rlfabric.rewards import RewardInput, register_reward
from rlfabric.run.log import read_metrics

HANGING_PROMPT = "4+4="


def hangs_on_one_prompt(inputs: list[RewardInput]) -> list[dict[str, float]]:
    if inputs[0].prompt == HANGING_PROMPT:
        time.sleep(1000)
    return [{} for _ in inputs]


register_reward("test_faults_hangs", hangs_on_one_prompt)


def same_for_everyone(inputs: list[RewardInput]) -> list[dict[str, float]]:
    return [{"constant": 0.5} for _ in inputs]


register_reward("test_faults_constant", same_for_everyone)


def train_in_process(cfg, run_dir: Path, during=None, quiet: bool = True) -> tuple[dict, list[dict]]:
    """Train to the end; ``during(trainer)`` runs on a thread once the actors are up."""
    trainer = GRPOTrainer(cfg, run_dir, quiet=quiet)
    try:
        trainer.setup()
        helper = threading.Thread(target=during, args=(trainer,), daemon=True) if during else None
        if helper:
            helper.start()
        summary = trainer.train()
        if helper:
            helper.join(timeout=60)
    finally:
        trainer.close()
    return summary, read_metrics(run_dir)


def live_pid(trainer: GRPOTrainer, which: str, not_one_of: list[int]) -> int:
    """The pid of the live generator or rollout worker now in its slot (the driver may still be replacing the one
    killed last)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        slots = trainer.generators if which == "generator" else trainer.rollout_workers
        try:
            pid = ray.get(slots.handles[0].pid.remote(), timeout=30)
        except ray.exceptions.RayError:
            pid = None
        if pid is not None and pid not in not_one_of:
            return pid
        time.sleep(0.05)
    raise TimeoutError(f"no live {which} to kill within 120 s")


def kill_generators(kills: list[tuple[int, float]], killed: list[int]):
    """After GRPO step k is logged, wait ``delay`` seconds and SIGKILL the live generator, for each (k, delay)."""

    def run(trainer: GRPOTrainer) -> None:
        for after_step, delay in kills:
            while trainer.counters.step < after_step:
                time.sleep(0.02)
            time.sleep(delay)
            pid = live_pid(trainer, "generator", killed)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    return run


# Kills land in every phase: right as a step's rollout starts generating, in the middle of the learner's update
# (with the weight load queued behind it), and between steps. The steps after the last kill must outlast its
# delay: on this tiny model a step can take well under 0.1 s, so 4 of them could end the run before it landed.
KILLS = [(1, 0.0), (3, 0.15), (5, 0.4)]
STEPS = 15


@pytest.mark.parametrize("lag", [0, 1])
def test_a_generator_killed_at_any_moment_costs_no_sample(local_ray, tmp_path, lag):
    cfg = config_from_dict(
        merged(
            BASE,
            {
                "rewards": {"functions": [{"name": "arithmetic"}]},
                "training": {"total_steps": STEPS, "max_policy_lag": lag},
                "generator": {"timeout_s": 60},
            },
        )
    )
    killed: list[int] = []
    summary, rows = train_in_process(cfg, tmp_path / "run", during=kill_generators(KILLS, killed))
    steps = [r for r in rows if r.get("phase") == "grpo"]
    assert len(killed) == len(KILLS) and len(set(killed)) == len(KILLS)  # different processes
    assert summary["generator_restarts"] == len(KILLS)
    batch = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    # every step trained on a full batch, and every sample counted once: lost work was asked again, not dropped
    assert [r["trained_samples"] for r in steps] == [batch] * STEPS
    assert summary["samples"] == STEPS * batch and summary["failed_samples"] == 0
    assert max(r["policy_lag_mean"] for r in steps) <= lag


# After GRPO step k is logged, wait the delay and SIGKILL the live actor: generators and the rollout worker die
# while episodes of several turns are in flight (the env's steps take 20 ms, so a step's episodes last a while).
MID_EPISODE_KILLS = [(1, 0.1, "generator"), (3, 0.1, "rollout worker"), (5, 0.3, "generator")]
EPISODE_STEPS = 10


def kill_mid_episode(killed: list[int]):
    """``during``: the ``MID_EPISODE_KILLS``, each pid appended to ``killed``."""

    def kill(trainer: GRPOTrainer) -> None:
        for after_step, delay, which in MID_EPISODE_KILLS:
            while trainer.counters.step < after_step:
                time.sleep(0.02)
            time.sleep(delay)
            pid = live_pid(trainer, which, killed)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    return kill


class SlowGuess:
    """GuessNumber with 20 ms steps: the kills land while episodes wait on the env between turns."""

    def __init__(self) -> None:
        from rlfabric.envs.guess_number import GuessNumber

        self.game = GuessNumber(10)

    def reset(self, task):
        return self.game.reset(task)

    async def step(self, action):
        await asyncio.sleep(0.02)
        return self.game.step(action)


register_env("test-faults/SlowGuess-v0", SlowGuess)


@pytest.mark.parametrize("lag", [0, 1])
def test_a_generator_and_a_rollout_worker_killed_mid_episode_cost_no_episode(local_ray, tmp_path, lag):
    cfg = config_from_dict(
        merged(
            BASE,
            {
                "model": {"builtin": {**TINY, "max_positions": 256}},
                "data": {"train": "task:guess_number?min_high=4&max_high=10", "num_train": 16, "num_eval": 4},
                "env": {"id": "test-faults/SlowGuess-v0", "max_turns": 3, "step_timeout_s": 5.0},
                "rewards": {"functions": [], "weights": {"invalid": -0.5}},
                "training": {"total_steps": EPISODE_STEPS, "max_policy_lag": lag},
                "generator": {"timeout_s": 60},
            },
        )
    )
    killed: list[int] = []
    summary, rows = train_in_process(cfg, tmp_path / "run", during=kill_mid_episode(killed))
    steps = [r for r in rows if r.get("phase") == "grpo"]
    assert len(killed) == 3 and summary["generator_restarts"] == 2 and summary["rollout_worker_restarts"] == 1
    batch = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    # every step trained one full batch of episodes: the lost ones were counted and played again, none twice
    assert [r["trained_samples"] for r in steps] == [batch] * EPISODE_STEPS
    assert summary["samples"] == EPISODE_STEPS * batch and summary["failed_samples"] == 0
    assert summary["resampled_samples"] >= batch  # the rollout worker died mid-rollout: its episodes asked again
    assert max(r["policy_lag_max"] for r in steps) <= lag
    assert max(r["turns_mean"] for r in steps) > 1


async def slow_guessing_agent(task, client):
    """An outside agent of three calls, 20 ms of its own work after each: the kills land while its episodes wait
    on it or on the endpoint."""
    messages = [{"role": "user", "content": f"Guess my number, 1 to {task['high']}."}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        await asyncio.sleep(0.02)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "higher"}]
    return {"correct": float(str(task["secret"]) in (reply.choices[0].message.content or ""))}


register_agent("test-faults/slow-guessing", slow_guessing_agent)


def test_a_generator_and_a_rollout_worker_killed_mid_agent_episode_cost_no_episode(local_ray, tmp_path):
    """As above with an outside agent through the endpoint: a call the dead generator cannot answer fails the
    whole rollout (not its episode), which is asked again."""
    cfg = config_from_dict(
        merged(
            BASE,
            {
                "model": {"builtin": {**TINY, "max_positions": 256}},
                "data": {"train": "task:guess_number?min_high=4&max_high=10", "num_train": 16, "num_eval": 4},
                "env": {"agent": "test-faults/slow-guessing", "agent_timeout_s": 60},
                "rewards": {"functions": []},
                "training": {"total_steps": EPISODE_STEPS},
                "generator": {"timeout_s": 60},
            },
        )
    )
    killed: list[int] = []
    summary, rows = train_in_process(cfg, tmp_path / "run", during=kill_mid_episode(killed))
    steps = [r for r in rows if r.get("phase") == "grpo"]
    assert len(killed) == 3 and summary["generator_restarts"] == 2 and summary["rollout_worker_restarts"] == 1
    batch = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    assert [r["trained_samples"] for r in steps] == [batch] * EPISODE_STEPS
    assert summary["samples"] == EPISODE_STEPS * batch and summary["failed_samples"] == 0
    assert summary["resampled_samples"] >= batch
    assert all(r["turns_mean"] == 3 and r["rewrites"] == 0 for r in steps)


def test_a_reward_that_hangs_on_every_call_is_survived(local_ray, tmp_path, capsys):
    """One prompt in eight hangs its reward on every step's call (rewards.timeout_s=2): that group fails, the
    service is replaced once per call, and the run goes on, since each replacement returned the other groups. The
    console says why the worker was replaced, once, not every step."""
    prompts = ["1+1=", "2+5=", "3+3=", "4+1=", "2+2=", "6+3=", "5+3=", HANGING_PROMPT]
    cfg = config_from_dict(
        merged(
            BASE,
            {
                "data": {
                    "train": write_prompts(tmp_path / "train.jsonl", prompts),
                    "eval": write_prompts(tmp_path / "eval.jsonl", ["1+2=", "5+1=", "2+6=", "4+5="]),
                    "num_train": None,
                    "num_eval": 4,
                },
                "rewards": {"functions": [{"name": "arithmetic"}, {"name": "test_faults_hangs"}], "timeout_s": 2.0},
                "grpo": {"prompts_per_step": 8},
                "training": {"total_steps": 6},
            },
        )
    )
    summary, rows = train_in_process(cfg, tmp_path / "run", quiet=False)
    steps = [r for r in rows if r.get("phase") == "grpo"]
    assert len(steps) == 6  # more replacements in a row than the limit of 5, and no abort
    assert summary["reward_worker_restarts"] >= 6
    replaced = [line for line in capsys.readouterr().err.splitlines() if " replaced (" in line]
    assert replaced and len(replaced) <= cfg.rewards.num_workers, replaced
    assert all(
        re.fullmatch(
            r"rlfabric: reward worker (\d) replaced \(reward worker \1 was poisoned by a timed-out group\)", line
        )
        for line in replaced
    ), replaced
    group = cfg.grpo.group_size
    assert [r["trained_samples"] for r in steps] == [7 * group] * 6  # all but the hanging group, every step
    assert summary["failed_samples"] == 6 * group


def test_a_reward_that_tells_no_completion_apart_is_said_to_give_no_gradient(local_ray, tmp_path):
    """Every completion of a group gets the same reward: every advantage is 0 and the policy cannot move. The run
    said nothing (trained_samples counted every sample); after three such steps in a row it says why, once."""
    rewards = {"functions": [{"name": "test_faults_constant"}], "weights": {"constant": 1.0}}
    run = run_grpo(tmp_path / "run", quiet=False, rewards=rewards, training={"total_steps": 4})
    assert [r["flat_groups"] for r in run.phase("grpo")] == [2, 2, 2, 2]  # both groups of every step
    notes = [line for line in run.console.splitlines() if "no reward spread" in line]
    assert notes == [
        "rlfabric: no reward spread in 3 steps in a row: every group's completions got equal rewards, so their "
        "advantages are 0 and the policy gradient is zero (check that the reward tells completions apart; "
        "grpo.dynamic_sampling: true samples other prompts instead)"
    ]


ALWAYS_RAISES = """
import rlfabric.rewards as rewards


def judge_everything(inputs):
    raise RuntimeError("the judge is down")


rewards.register_reward("always_raises", judge_everything)
"""


@pytest.mark.parametrize(
    ("spec", "imports"),
    [("always_raises", ["--import", "flaky_rewards"]), ("flaky_rewards:judge_everything", [])],
    ids=["registered_by_an_imported_module", "module_function_spec_from_the_current_directory"],
)
def test_a_reward_that_raises_on_every_call_stops_the_run_with_its_name_and_error(tmp_path, spec, imports):
    """Registered by a module given to --import, or named ``module:function`` for a module in the current
    directory (without --import: the function reaches the reward actors by value)."""
    (tmp_path / "flaky_rewards.py").write_text(ALWAYS_RAISES)
    args = ["--run-dir", str(tmp_path / "run"), "--quiet", *imports]
    overrides = [
        "model.builtin={num_layers: 1, hidden_size: 32, num_heads: 2, max_positions: 64}",
        "sft.steps=0",
        "data.num_eval=4",
        f"rewards.functions=[{{name: {spec!r}}}]",
    ]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rlfabric.cli", "train", *overrides, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert done.returncode == 1, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("rlfabric:")]
    assert any(f"{spec}: RuntimeError: the judge is down" in line for line in errors), errors
    stopped = [line for line in errors if line.startswith("rlfabric: run stopped")]
    assert stopped and stopped[0].endswith(f"nothing was trained; a new run may use --run-dir {tmp_path / 'run'} again")
    assert time.monotonic() - started < 200  # stopped at the first evaluation, not after the whole run
    assert not [r for r in read_metrics(tmp_path / "run") if r.get("phase") == "grpo"]


def test_a_killed_learner_is_named_and_its_checkpoint_resumes(local_ray, tmp_path):
    cfg = config_from_dict(merged(BASE, {"training": {"total_steps": 6, "checkpoint_every": 2}}))

    def kill_learner_after_step_3(trainer: GRPOTrainer) -> None:
        while trainer.counters.step < 3:
            time.sleep(0.02)
        os.kill(ray.get(trainer.learners[0].pid.remote(), timeout=60), signal.SIGKILL)

    from rlfabric.actor_slots import RunAbortedError

    # the kill lands in step 4's update, the weight publication after an update, or the checkpoint save after step 4
    # (an incomplete checkpoint, not resumed): which one, the machine's timing decides
    named = r"learner 0 failed during (its update|the weight publication) at step [34]|the checkpoint save at step 4"
    with pytest.raises(RunAbortedError, match=named):
        train_in_process(cfg, tmp_path / "run", during=kill_learner_after_step_3)
    resumed = GRPOTrainer.from_run_dir(tmp_path / "run", quiet=True)
    assert resumed.resume_from is not None and resumed.resume_from.name == "step_000002"
    try:
        summary = resumed.train()
    finally:
        resumed.close()
    assert summary["steps"] == 6
    steps = [r["step"] for r in read_metrics(tmp_path / "run") if r.get("phase") == "grpo"]
    assert steps == [1, 2, 3, 4, 5, 6]  # the steps after the checkpoint were redone, each logged once


def test_reward_workers_asking_for_a_gpu_the_cluster_lacks_are_refused_before_any_actor_starts(local_ray, tmp_path):
    cfg = config_from_dict(merged(BASE, {"rewards": {"num_gpus": 1}}))
    trainer = GRPOTrainer(cfg, tmp_path / "run", quiet=True)
    try:
        with pytest.raises(
            ConfigError, match=r"rewards.num_cpus/num_gpus/resources ask for CPU=0.25, GPU=1 per actor, which no node"
        ):
            trainer.setup()
        assert trainer.generators is None and trainer.learners == []
    finally:
        trainer.close()


def test_actors_the_cluster_cannot_place_are_refused_before_they_start(local_ray, tmp_path):
    cfg = config_from_dict(merged(BASE, {"learner": {"num_learners": 2, "num_cpus": 3}}))
    trainer = GRPOTrainer(cfg, tmp_path / "run", quiet=True)
    try:
        with pytest.raises(ConfigError, match=r"ask for .*CPU=.* in all .*learner: 2 x CPU=3.* but the cluster has"):
            trainer.setup()
        assert trainer.learners == []  # refused before any learner started
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("first", "second", "kind"),
    [  # errors that differ only in the sample they quote are one kind: the run prints the first, counts the rest
        (
            "doubled: ValueError: cannot parse completion '12x'",
            "doubled: ValueError: cannot parse completion 'ab'",
            "doubled: ValueError",
        ),
        (
            "judge: no verdict that parses after 3 tries; it wrote 'er=4)er0'",
            "judge: no verdict that parses after 3 tries; it wrote 'zz'",
            "judge: no verdict that parses after … tries; it wrote …",
        ),
    ],
)
def test_reward_errors_of_one_kind_are_one_kind_whatever_sample_they_quote(first, second, kind):
    assert error_kind(first) == error_kind(second) == kind
    assert error_kind("doubled: TypeError: bad operand") != error_kind(first)  # another exception: another kind
