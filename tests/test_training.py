"""End-to-end training on a local Ray: learning, sync/async, resume, and the CLI's outputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import ray
import torch

import rlfabric
from rlfabric.config import ppo_config_from_dict as config_from_dict
from rlfabric.driver import Trainer, latest_checkpoint


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_cartpole_learns_to_475(local_ray, tmp_path, train):
    """The default PPO config reaches a 100-episode mean return of 475 on CartPole-v1 (seeded)."""
    cfg = config_from_dict({"training": {"seed": 0, "stop_return": 475.0, "total_env_steps": 250_000}})
    summary, rows = train(cfg, tmp_path)
    assert summary["episode_return_mean"] >= 475, summary
    assert summary["env_steps"] < 250_000  # stopped by stop_return, not by the budget
    assert summary["eval_return_mean"] >= 475, summary
    assert [r["iteration"] for r in rows] == list(range(1, len(rows) + 1))
    assert all(r["policy_lag_mean"] == 0 for r in rows)  # max_policy_lag 0 is synchronous
    assert rows[0]["episode_return_mean"] < 100  # it really learned
    for name in ("config.yaml", "summary.json", "learning_curve.png"):
        assert (tmp_path / name).is_file(), name
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert latest_checkpoint(tmp_path) is not None
    assert len(list((tmp_path / "checkpoints").glob("iter_*.pt"))) == 3  # training.keep_checkpoints


def test_gaussian_policy_improves_on_point_mass(local_ray, tmp_path, train):
    """The continuous path (Gaussian policy, obs and reward normalization) learns on the shipped PointMass env:
    a random policy scores about -110 there, one that reaches the goal about -5."""
    cfg = config_from_dict(
        {
            "env": {"id": "rlfabric/PointMass-v0"},
            "ppo": {
                "train_batch_size": 1024,
                "minibatch_size": 128,
                "num_epochs": 10,
                "lr": 3e-4,
                "gamma": 0.99,
                "gae_lambda": 0.95,
                "normalize_obs": True,
                "normalize_reward": True,
                "clip_value_loss": True,
            },
            "training": {"total_env_steps": 60_000, "seed": 0, "eval_episodes": 20},
        }
    )
    summary, rows = train(cfg, tmp_path)
    first, last = rows[0]["episode_return_mean"], rows[-1]["episode_return_mean"]
    assert last > first + 30, (first, last)
    assert summary["eval_return_mean"] > -40, summary


def test_async_mode_bounds_policy_lag(local_ray, tmp_path, train):
    """max_policy_lag=1: runners sample during updates; no trained fragment is more than one version old."""
    cfg = config_from_dict({"training": {"max_policy_lag": 1, "total_env_steps": 20_000, "eval_episodes": 0}})
    _, rows = train(cfg, tmp_path)
    lags = [r["policy_lag_mean"] for r in rows]
    assert max(lags) <= 1.0
    assert max(lags) > 0  # some fragments really were sampled during an update
    assert rows[-1]["env_steps"] >= 20_000
    assert rows[-1]["env_steps_sampled"] >= rows[-1]["env_steps"]


MARKER_OBS = 1000.0  # what a stalled runner's first fragment observes: far outside anything CartPole shows


class StallFirstFragmentEnv(gym.Wrapper):
    """CartPole in which one runner (whichever creates its env first) stalls its first fragment until the learner
    has made ``wait_rows`` updates (rows in ``metrics``), and marks that fragment's observations ``MARKER_OBS``.

    The stalled fragment was sampled with policy version 0, so it arrives too stale to train on; the marked
    observations would show in the learner's observation statistics if it were trained on anyway.
    """

    def __init__(self, claim: str, metrics: str, wait_rows: int, fragment_length: int) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.metrics, self.wait_rows, self.fragment_length, self.steps = Path(metrics), wait_rows, fragment_length, 0
        mine = Path(f"{claim}.{os.getpid()}")
        mine.write_text(str(os.getpid()))
        try:
            os.link(mine, claim)  # atomic: the first process to link is the stalling one
        except FileExistsError:
            pass
        self.stalling = Path(claim).read_text() == str(os.getpid())

    def _marked(self, obs: np.ndarray) -> np.ndarray:
        # Observations 0..fragment_length-1 (the reset's and the first steps') make up the runner's first fragment.
        return np.full_like(obs, MARKER_OBS) if self.stalling and self.steps < self.fragment_length else obs

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return self._marked(obs), info

    def step(self, action):
        if self.stalling and self.steps == 0:
            deadline = time.monotonic() + 60
            while len(_lines(self.metrics)) < self.wait_rows and time.monotonic() < deadline:
                time.sleep(0.05)
        self.steps += 1
        obs, reward, terminated, truncated, info = self.env.step(action)
        return self._marked(obs), reward, terminated, truncated, info


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_stale_fragments_are_dropped_and_counted(local_ray, tmp_path):
    """A fragment older than max_policy_lag versions never reaches the learner; the drop is counted, and its steps
    count as sampled but not as trained."""
    rlfabric.register_env("stall-first-fragment", StallFirstFragmentEnv)
    run_dir, lag, wait_rows = tmp_path / "run", 2, 4
    cfg = config_from_dict(
        {
            "env": {"id": "stall-first-fragment"},
            "training": {"max_policy_lag": lag, "total_env_steps": 12 * 256, "eval_episodes": 0},
        }
    )
    cfg.env.kwargs = {
        "claim": str(tmp_path / "claim"),
        "metrics": str(run_dir / "metrics.jsonl"),
        "wait_rows": wait_rows,
        "fragment_length": cfg.fragment_length,
    }
    trainer = Trainer(cfg, run_dir, quiet=True)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    rows = _rows(run_dir)
    fragment_steps = cfg.fragment_length * cfg.runners.envs_per_runner
    # The stalled fragment (version 0) arrived once the learner had made at least wait_rows > lag updates.
    assert summary["dropped_fragments"] >= 1 and rows[-1]["dropped_fragments"] == summary["dropped_fragments"]
    assert all(r["policy_lag_mean"] <= lag for r in rows), [r["policy_lag_mean"] for r in rows]
    assert [r["env_steps"] for r in rows] == [256 * r["iteration"] for r in rows]  # every batch: fresh fragments
    dropped_steps = summary["dropped_fragments"] * fragment_steps
    assert rows[-1]["env_steps_sampled"] >= rows[-1]["env_steps"] + dropped_steps
    # What the learner trained on: exactly the counted steps, and none of the stalled fragment's marked observations.
    learner = torch.load(latest_checkpoint(run_dir), weights_only=False)["learner"]
    assert learner["obs_stats"]["count"] == summary["env_steps"]
    assert np.abs(learner["obs_stats"]["mean"]).max() < 5, learner["obs_stats"]["mean"]


class HangsInEvaluation(gym.Wrapper):
    """CartPole whose reset hangs on the final evaluation's seed (training.seed + 12345) alone."""

    def __init__(self):
        super().__init__(gym.make("CartPole-v1"))

    def reset(self, **kwargs):
        if kwargs.get("seed") == 12345:
            threading.Event().wait()
        return self.env.reset(**kwargs)


def test_a_hung_evaluation_is_skipped_naming_its_deadline(local_ray, tmp_path, capsys):
    rlfabric.register_env("hangs-in-evaluation", HangsInEvaluation)
    cfg = config_from_dict(
        {
            "env": {"id": "hangs-in-evaluation"},
            "runners": {"sample_timeout_s": 4},
            "training": {"total_env_steps": 512, "eval_episodes": 2, "seed": 0},
        }
    )
    trainer = Trainer(cfg, tmp_path / "run", quiet=False)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    assert summary["env_steps"] == 512  # the run itself is kept; only its evaluation is missing
    # Ray's own words were "Get timed out: some object(s) not ready"
    assert (
        "rlfabric: evaluation skipped: it did not finish within 4s (runners.sample_timeout_s)"
        in capsys.readouterr().err
    )


def test_a_total_that_is_not_whole_batches_is_said_once_and_trained_to_the_next_batch(local_ray, tmp_path, capsys):
    """100 env steps with a train batch of 256: one line at the start says the run trains 256, and the progress
    line counts toward 256 (100.0% at the end, not 256.0%)."""
    cfg = config_from_dict({"training": {"total_env_steps": 100, "eval_episodes": 0}})
    trainer = Trainer(cfg, tmp_path / "run", quiet=False)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    assert summary["env_steps"] == 256
    err = capsys.readouterr().err
    said = (
        "rlfabric: training.total_env_steps = 100 is not a whole number of train batches (ppo.train_batch_size = "
        "256): the run trains 256 env steps (1 batch)"
    )
    assert err.count(said) == 1, err
    assert "env steps        256 (100.0%)" in err
    whole = Trainer(config_from_dict({"training": {"total_env_steps": 512}}), tmp_path / "other", quiet=True)
    assert whole._steps_to_train() == 512  # whole batches: nothing to say


def test_resume_continues_at_the_same_step_and_statistics(local_ray, tmp_path):
    """A run interrupted from the CLI resumes from its checkpoint with the same env step and normalizer stats."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "rlfabric.cli", "train", "algo=ppo", "training.total_env_steps=1000000",
        "training.checkpoint_every=3", "ppo.normalize_obs=true", "ppo.normalize_reward=true",
        "--run-dir", str(run_dir), "--quiet",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints" / "iter_000006.pt").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().endswith(f"interrupted; the latest checkpoint is kept (continue with --resume {run_dir})")

    ckpt = torch.load(latest_checkpoint(run_dir), weights_only=False)
    saved_iter, saved_steps = ckpt["progress"]["iteration"], ckpt["progress"]["env_steps"]
    assert saved_iter >= 6

    trainer = Trainer.from_run_dir(run_dir, [f"training.total_env_steps={saved_steps + 2048}"], quiet=True)
    try:
        trainer.setup()
        assert trainer.progress.env_steps == saved_steps
        state = ray.get(trainer.learner.state.remote())
        for key in ("count", "mean", "m2"):
            np.testing.assert_array_equal(state["obs_stats"][key], ckpt["learner"]["obs_stats"][key])
            np.testing.assert_array_equal(state["return_stats"][key], ckpt["learner"]["return_stats"][key])
        assert state["version"] == ckpt["learner"]["version"]
        for name, tensor in ckpt["learner"]["model"].items():
            torch.testing.assert_close(state["model"][name], tensor)
        trainer.train()
    finally:
        trainer.close()
    rows = _rows(run_dir)
    assert [r["iteration"] for r in rows] == list(range(1, len(rows) + 1))  # no gap, no repeat
    resumed = rows[saved_iter]
    assert resumed["env_steps"] == saved_steps + 256
    assert rows[-1]["env_steps"] >= saved_steps + 2048


def test_cli_train_writes_outputs_and_summary(tmp_path):
    """`rlfabric train --import MODULE` trains on an env that module registers, in a fresh process."""
    (tmp_path / "my_cli_envs.py").write_text(
        "import gymnasium as gym\nimport rlfabric\n\n"
        "rlfabric.register_env('short-pole', lambda steps=50: gym.make('CartPole-v1', max_episode_steps=steps))\n"
    )
    run_dir = tmp_path / "cli"
    out = subprocess.run(
        [sys.executable, "-m", "rlfabric.cli", "train", "algo=ppo", "env.id=short-pole", "env.kwargs={steps: 20}",
         "training.total_env_steps=3000", "--import", "my_cli_envs", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rlfabric run summary" in out.stdout
    assert "env steps" in out.stderr  # the progress line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_steps"] >= 3000
    assert summary["eval_return_mean"] <= 20  # the registered env with its kwargs, not plain CartPole
    rows = _rows(run_dir)
    assert all("env_steps" in r and "episode_return_mean" in r for r in rows)


def test_placement_group_and_per_role_resources(local_ray, tmp_path):
    """ray.placement_strategy reserves the learner and runners as one placement group; each actor takes its own
    bundle (with unequal bundles, a runner landing in the learner's would leave the learner unplaceable)."""
    cfg = config_from_dict(
        {
            "runners": {"num_cpus": 0.5},
            "learner": {"num_cpus": 1.0},
            "ray": {"placement_strategy": "PACK"},
            "training": {"total_env_steps": 2_000, "eval_episodes": 0},
        }
    )
    trainer = Trainer(cfg, tmp_path, quiet=True)
    try:
        trainer.setup()
        table = ray.util.placement_group_table(trainer.placement_group)
        assert table["strategy"] == "PACK" and len(table["bundles"]) == 1 + 2
        assert table["bundles"][0] == {"CPU": 1.0} and table["bundles"][1] == {"CPU": 0.5}
        summary = trainer.train()
    finally:
        trainer.close()
    assert summary["env_steps"] >= 2_000


def test_ctrl_c_during_an_update_keeps_checkpoint_metrics_and_weights_in_step(local_ray, tmp_path):
    """Ctrl-C (a real SIGINT) while the learner is busy with an update: the run finishes that update, then stops
    with a checkpoint whose iteration, learner version and env steps agree with the last metrics row, so a resumed
    run (see test_resume_continues_at_the_same_step_and_statistics) neither skips nor repeats an iteration."""
    cfg = config_from_dict(
        {
            # Async sampling and slow updates (160 minibatch steps each): the next batch is sampled before an update
            # ends, so the next update starts at once and is in flight whenever the stop request is honoured.
            "ppo": {"num_epochs": 20, "minibatch_size": 32},
            "training": {"max_policy_lag": 1, "total_env_steps": 100_000, "checkpoint_every": 0, "eval_episodes": 0},
        }
    )
    run_dir, signal_at_rows = tmp_path / "run", 2
    done = threading.Event()

    def press_ctrl_c() -> None:  # as soon as update 2's metrics row is written
        while not done.is_set():
            if len(_lines(run_dir / "metrics.jsonl")) >= signal_at_rows:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.005)

    trainer = Trainer(cfg, run_dir, quiet=True)
    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    try:
        trainer.setup()
        presser.start()
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
    finally:
        done.set()
        presser.join()
        trainer.close()
    ckpt = torch.load(latest_checkpoint(run_dir), weights_only=False)
    rows = _rows(run_dir)
    stopped_at = rows[-1]["iteration"]
    assert stopped_at > signal_at_rows  # the update in flight at the signal was finished and kept
    assert ckpt["progress"]["iteration"] == stopped_at == ckpt["learner"]["version"]
    assert ckpt["progress"]["env_steps"] == rows[-1]["env_steps"] == stopped_at * 256
    assert [r["iteration"] for r in rows] == list(range(1, stopped_at + 1))


def test_seeded_sync_runs_are_repeatable(local_ray, tmp_path, train):
    """Same seed, same config, sync mode: the same losses, iteration by iteration."""
    cfg = config_from_dict({"training": {"seed": 7, "total_env_steps": 5_000, "eval_episodes": 0}})
    losses = [[r["policy_loss"] for r in train(cfg, tmp_path / str(k))[1]] for k in range(2)]
    assert losses[0] == losses[1] and len(losses[0]) >= 19
