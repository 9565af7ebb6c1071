"""Faults: a runner process killed with SIGKILL, an env that hangs, an env that raises. Each is survived."""

from __future__ import annotations

import inspect
import json
import os
import re
import time
from pathlib import Path

import gymnasium as gym
import pytest
import ray
from runner_faults import kill_runner_after

import rlfabric
from rlfabric.config import ppo_config_from_dict as config_from_dict
from rlfabric.driver import Trainer


class FailOnceEnv(gym.Wrapper):
    """CartPole that, the first time any copy of it reaches step ``at_step``, hangs or raises.

    "First time" is shared across processes through a marker file, so the replacement runner behaves.
    """

    def __init__(self, marker: str, mode: str, at_step: int = 20) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.marker, self.mode, self.at_step, self.steps = Path(marker), mode, at_step, 0

    def step(self, action):
        self.steps += 1
        if self.steps == self.at_step:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL)  # only one copy ever wins this
            except FileExistsError:
                pass
            else:
                os.close(fd)
                if self.mode == "hang":
                    time.sleep(3600)
                raise RuntimeError("env exploded on purpose")
        return self.env.step(action)


def _config(tmp_path: Path, **training) -> rlfabric.Config:
    return config_from_dict(
        {
            "env": {"id": "fail-once", "kwargs": {"marker": str(tmp_path / "marker"), "mode": "raise"}},
            "runners": {"sample_timeout_s": 5.0},
            "training": {"total_env_steps": 6_000, "eval_episodes": 0, **training},
        }
    )


@pytest.fixture(autouse=True)
def _register():
    rlfabric.register_env("fail-once", FailOnceEnv)


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_failing_env_costs_one_fragment(local_ray, tmp_path, mode, train):
    cfg = _config(tmp_path)
    cfg.env.kwargs["mode"] = mode
    start = time.monotonic()
    summary, rows = train(cfg, tmp_path / "run")
    assert (tmp_path / "marker").exists()  # the failure really happened
    assert summary["env_steps"] >= 6_000
    assert summary["runner_restarts"] == 1 and summary["lost_fragments"] == 1
    assert rows[-1]["runner_restarts"] == 1
    reason = summary["runner_failures"][0]
    assert ("exploded on purpose" in reason) if mode == "raise" else ("deadline" in reason)
    assert time.monotonic() - start < 120  # the hang cost one deadline, not the run


def test_killed_runner_is_replaced_and_its_fragment_recollected(local_ray, tmp_path):
    """kill -9 of a runner's process mid-run: the run finishes, with the restart and lost fragment counted."""
    cfg = config_from_dict(
        {
            "env": {"id": "gym:CartPole-v1"},
            "ppo": {"train_batch_size": 8000, "minibatch_size": 1000, "num_epochs": 1},
            "runners": {"sample_timeout_s": 60.0},
            "training": {"total_env_steps": 80_000, "eval_episodes": 0},
        }
    )
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg, run_dir, quiet=True)
    try:
        trainer.setup()
        killer, killed = kill_runner_after(trainer, run_dir, rows=2)
        summary = trainer.train()
        killer.join(timeout=5)
    finally:
        trainer.close()
    assert killed, "the runner was never killed"
    assert summary["env_steps"] >= 80_000
    assert summary["runner_restarts"] >= 1 and summary["lost_fragments"] >= 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["runner_restarts"] >= 1
    # Every iteration still trained on a full batch: the lost fragment was collected again.
    assert all(b["env_steps"] - a["env_steps"] == 8000 for a, b in zip(rows, rows[1:], strict=False))


def test_env_that_always_fails_stops_the_run_with_its_error(local_ray, tmp_path):
    """A bug in the env is not retried forever: after repeated failures the run stops and names the error."""
    from rlfabric.runner_pool import MAX_CONSECUTIVE_FAILURES, RunAbortedError

    rlfabric.register_env("always-fails", lambda: _AlwaysFails())
    cfg = config_from_dict({"env": {"id": "always-fails"}, "training": {"total_env_steps": 2_000}})
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        with pytest.raises(
            RunAbortedError, match=f"failed {MAX_CONSECUTIVE_FAILURES + 1} times in a row.*always broken"
        ) as raised:
            trainer.train()
    finally:
        trainer.close()
    assert list((tmp_path / "run" / "checkpoints").glob("iter_*.pt"))  # nothing done is lost
    # where in the user's code it was raised: the env's step, not Ray's or rlfabric's frames around it
    raise_line = inspect.getsourcelines(_AlwaysFails.step)[1] + 1
    assert f"always broken (at test_faults.py:{raise_line}, in step)" in str(raised.value)


class _AlwaysFails(gym.Wrapper):
    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))

    def step(self, action):
        raise ValueError("always broken")


def test_episode_ids_stay_unique_across_runners_and_a_resumed_run(local_ray, tmp_path):
    """Each runner a run starts (resumed sessions' too) numbers its rows in a range of its own, so the record's
    episode ids are unique within the run, as docs/trajectories.md says."""
    cfg = config_from_dict(
        {
            "env": {"id": "gym:CartPole-v1"},
            "runners": {"num_runners": 2},
            "ppo": {"train_batch_size": 512, "minibatch_size": 256, "num_epochs": 1},
            "training": {"total_env_steps": 1024, "eval_episodes": 0, "checkpoint_every": 1},
        }
    )
    run_dir = tmp_path / "run"

    def episode_ids(trainer: Trainer) -> list[int]:
        return [i for k in range(2) for i in trainer.pool.call(k, "sample", timeout=60)[1].episode_id.tolist()]

    first = Trainer(cfg, run_dir, quiet=True)
    try:
        first.setup()
        ids = episode_ids(first)
        first.train()
    finally:
        first.close()
    resumed = Trainer.from_run_dir(run_dir, ["training.total_env_steps=1536"], quiet=True)
    try:
        resumed.setup()
        later = episode_ids(resumed)
    finally:
        resumed.close()
    assert len(ids) == len(later) == 2 * 4  # a row per env copy, 4 copies per runner
    assert len(set(ids)) == len(ids) and len(set(later)) == len(later)
    assert not set(ids) & set(later)


def test_a_long_actor_death_is_said_to_its_last_whole_sentence():
    """Ray's text for a killed actor ends in a 600-character line of possible causes: the one-line summary a run
    prints ends at a sentence, not inside "(2) ray stop --force was"."""
    from rlfabric.actor_slots import error_summary

    died = RuntimeError(
        "The actor died unexpectedly before finishing this task.\n\tclass_name: Generator\n"
        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
        "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the "
        "process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called, or (3) the "
        "worker crashed unexpectedly due to SIGSEGV or another unexpected error."
    )
    assert error_summary(died) == (
        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
        "Worker unexpectedly exits with a connection error code 2. End of file."
    )
    assert error_summary(RuntimeError("short\nlast line")) == "last line"
    assert error_summary(RuntimeError("x" * 400)) == "x" * 297 + "..."
    # a sentence that ends early keeps what follows, up to the limit
    assert error_summary(RuntimeError("CUDA out of memory. " + "y" * 400)) == "CUDA out of memory. " + "y" * 277 + "..."


class _GlitchesThreeTimes(gym.Wrapper):
    """CartPole whose step 20 raises the first three times any copy of it gets there (marker files shared across
    processes), with the step's time in the message, so each failure's text differs."""

    def __init__(self, markers: str) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.markers, self.steps = Path(markers), 0

    def reset(self, **kwargs):
        self.steps = 0
        return self.env.reset(**kwargs)

    def step(self, action):
        self.steps += 1
        if self.steps == 20:
            for k in range(3):
                try:
                    os.close(os.open(self.markers / str(k), os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    continue
                raise RuntimeError(f"sensor glitch {time.monotonic():.6f}")
        return self.env.step(action)


def test_repeated_runner_failures_are_said_once_with_counts_and_the_first_traceback_kept(local_ray, tmp_path, capsys):
    rlfabric.register_env("glitches", _GlitchesThreeTimes)
    (tmp_path / "markers").mkdir()
    cfg = config_from_dict(
        {
            "env": {"id": "glitches", "kwargs": {"markers": str(tmp_path / "markers")}},
            "runners": {"num_runners": 1},
            "training": {"total_env_steps": 8_000, "eval_episodes": 0},
        }
    )
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg, run_dir, quiet=False)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    assert summary["runner_restarts"] == 3
    said = [line for line in capsys.readouterr().err.splitlines() if "sensor glitch" in line]
    assert len(said) == 2, said  # the first, then the second; the third is counted only
    assert said[0].endswith(f"(its whole error: {run_dir / 'errors.log'}; more of this kind are counted)")
    assert said[1].endswith("replaced it and asked again (2 failures of this kind so far)")
    errors = (run_dir / "errors.log").read_text()
    assert errors.count("\n== ") + errors.startswith("== ") == 1  # the first failure's entry only
    assert len(set(re.findall(r"sensor glitch (\d+\.\d+)", errors))) == 1
    assert f'{Path(__file__).name}", line' in errors and "\x1b[" not in errors  # the env's frame; no colours


@ray.remote(num_cpus=0)
class _Worker:
    def ping(self) -> int:
        return os.getpid()


def test_a_slot_that_fails_every_other_call_stops_the_run_whatever_its_role(local_ray):
    """Failures with a success between them never reach the in-a-row limit; every role's slots stop the run
    when half of a slot's last FAILURE_WINDOW outcomes were failures, with a new process after each."""
    from rlfabric.actor_slots import FAILURE_WINDOW, ActorSlots, RunAbortedError

    slots = ActorSlots("generator", lambda slot, generation: _Worker.remote(), 1)
    pids = []
    try:
        with pytest.raises(RunAbortedError) as raised:
            for call in range(FAILURE_WINDOW):
                _, generation, handle = slots.entries()[0]
                pids.append(ray.get(handle.ping.remote()))
                if call % 2:
                    slots.replace(0, generation, f"generator 0 died on call {call}")
                else:
                    slots.succeeded(0, generation)
    finally:
        slots.shutdown()
    half = FAILURE_WINDOW // 2
    assert str(raised.value) == (
        f"generator 0 failed {half} of its last {FAILURE_WINDOW} calls; last: generator 0 died on call "
        f"{FAILURE_WINDOW - 1}"
    )
    assert len(set(pids)) == half  # each failure before the last replaced the process
