"""NaN and infinity in a PPO run: an env that returns one is the env's error (the runner's fault path replaces it,
and stops the run when it keeps happening); the learner never applies an update that is not finite."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import rlfabric
from rlfabric.actors.learner import LearnerCore
from rlfabric.algorithms import ppo
from rlfabric.config import ppo_config_from_dict as config_from_dict
from rlfabric.driver import MAX_SKIPPED_UPDATES, Trainer
from rlfabric.models import ActionSpec
from rlfabric.runner_pool import FAILURE_WINDOW, MAX_CONSECUTIVE_FAILURES, RunAbortedError
from rlfabric.trajectory import from_time_major
from rlfabric.vector import EnvVector, NonFiniteEnvOutput


class BadAfter(gym.Wrapper):
    """CartPole whose pole never falls (episodes of ``length`` steps) and whose step number ``after`` of an episode
    and every later one gives a bad value: ``field`` "obs" (NaN observation), "reward" (NaN reward), "inf_reward",
    "huge_reward" (3e38: finite, but its advantages are not), or "final_obs" (a NaN final observation where the
    episode is cut at step ``after``). With ``marker``, only the first episode to get there anywhere does (a file
    shared across processes)."""

    def __init__(self, field: str = "obs", after: int = 50, marker: str | None = None, length: int = 500) -> None:
        super().__init__(gym.make("CartPole-v1", max_episode_steps=length))
        self.field, self.after, self.marker, self.t = field, after, marker, 0

    def reset(self, **kwargs):
        self.t = 0
        return self.env.reset(**kwargs)

    def _once(self) -> bool:
        if self.marker is None:
            return True
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))  # only one copy ever wins this
        except FileExistsError:
            return False
        return True

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.t += 1
        terminated = False  # long enough episodes: the pole never falls
        if self.t == self.after and self.field == "final_obs":
            truncated = True
        if self.t >= self.after and self._once():
            if self.field in ("obs", "final_obs"):
                obs = np.full_like(obs, np.nan)
            elif self.field == "reward":
                reward = float("nan")
            elif self.field == "inf_reward":
                reward = float("-inf")
            elif self.field == "huge_reward":
                reward = 3e38
        return obs, reward, terminated, truncated, info


rlfabric.register_env("test_nonfinite/bad-after", BadAfter)


# -- the env's error: EnvVector --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, said",
    [
        ("obs", "non-finite observation (nan at index 0) at step 5 of an episode (env copy 1)"),
        ("reward", "non-finite reward (nan) at step 5 of an episode (env copy 1)"),
        ("inf_reward", "non-finite reward (-inf) at step 5 of an episode (env copy 1)"),
        ("final_obs", "non-finite observation (nan at index 0) at step 5 of an episode (env copy 1)"),
    ],
)
def test_a_non_finite_observation_or_reward_is_the_envs_error_naming_field_and_step(field, said):
    vec = EnvVector([BadAfter("obs", after=1000), BadAfter(field, after=5)], name="my-env")
    vec.reset([0, 1])
    for _ in range(4):
        vec.step(np.array([0, 1]))
    with pytest.raises(NonFiniteEnvOutput) as info:
        vec.step(np.array([0, 1]))
    message = str(info.value)
    assert message.startswith(f"env 'my-env' returned a {said}")
    assert "\n" not in message


class _NanReset(gym.Wrapper):
    def __init__(self, on_reset: int) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.on_reset, self.resets = on_reset, 0

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self.resets += 1
        return (np.full_like(obs, np.nan) if self.resets == self.on_reset else obs), info

    def step(self, action):
        obs, reward, _, truncated, info = self.env.step(action)
        return obs, reward, True, truncated, info  # every episode is one step long


def test_a_non_finite_reset_observation_is_said_at_reset():
    with pytest.raises(
        NonFiniteEnvOutput, match=r"^env 'e' returned a non-finite observation \(nan at index 0\) at reset"
    ):
        EnvVector([_NanReset(on_reset=1)], name="e").reset([0])
    vec = EnvVector([_NanReset(on_reset=2)], name="e")
    vec.reset([0])
    with pytest.raises(NonFiniteEnvOutput, match=r"at reset \(after an episode of 1 steps\) \(env copy 0\)"):
        vec.step(np.array([0]))


# -- the learner's last guard ----------------------------------------------------------------------------------


def _learner_and_fragment(rewards: np.ndarray | None = None, seed: int = 0):
    """A CartPole learner (8 steps of 2 envs per batch) and a fragment of random data with ``rewards``."""
    cfg = config_from_dict(
        {
            "runners": {"num_runners": 1, "envs_per_runner": 2},
            "ppo": {"train_batch_size": 16, "minibatch_size": 4, "num_epochs": 2, "normalize_reward": True},
            "training": {"total_env_steps": 160},
        }
    )
    learner = LearnerCore(cfg.to_dict(), 4, ActionSpec("discrete", 2))
    rng = np.random.default_rng(seed)
    t, n = 8, 2
    rewards = np.ones((t, n), np.float32) if rewards is None else rewards
    fragment = from_time_major(
        obs=rng.normal(size=(t, n, 4)).astype(np.float32),
        actions=rng.integers(0, 2, size=(t, n)),
        logprobs=np.full((t, n), np.log(0.5), np.float32),
        rewards=rewards,
        terminated=np.zeros((t, n), bool),
        truncated=np.zeros((t, n), bool),
        version=0,
        bootstrap_obs=np.zeros((n, 4), np.float32),
        truncation_index=np.zeros((0, 2), np.int64),
        truncation_obs=np.zeros((0, 4), np.float32),
        extras={
            "obs_stats": {"count": 1.0, "mean": np.zeros(4), "m2": np.zeros(4)},
            "return_stats": {
                "count": float(t * n),
                "mean": np.ones(1),
                "m2": np.full(1, np.sum(rewards.astype(np.float64) ** 2)),
            },
        },
    )
    return learner, fragment


def _weights(learner: LearnerCore) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in learner.model.state_dict().items()}


def test_an_update_on_a_batch_that_is_not_finite_is_skipped_and_changes_nothing():
    rewards = np.ones((8, 2), np.float32)
    rewards[3, 1] = np.nan
    learner, fragment = _learner_and_fragment(rewards)
    before, stats_before = _weights(learner), learner.return_stats
    out = learner.update([fragment])
    assert out["update_skipped"] == 1.0
    assert out["skip_reason"] == "the return statistics merged from the batch's fragments are not finite"
    assert np.isnan(out["policy_loss"]) and out["epochs_run"] == 0.0
    for key, value in learner.model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    assert learner.return_stats is stats_before  # the batch's statistics were not merged
    assert learner.version == 1  # the version counts on; its weights are the last finite update's
    good_learner, good = _learner_and_fragment()
    assert good_learner.update([good])["update_skipped"] == 0.0


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_a_huge_but_finite_reward_is_caught_in_the_advantages():
    learner, fragment = _learner_and_fragment(np.full((8, 2), 3e38, np.float32))
    fragment.extras["return_stats"] = {"count": 1.0, "mean": np.zeros(1), "m2": np.zeros(1)}
    learner.cfg.ppo.normalize_reward = False
    out = learner.update([fragment])
    assert re.fullmatch(r"the batch's advantages are not finite at \d+ of its 16 steps", out["skip_reason"])


def test_a_loss_that_turns_nan_mid_update_rolls_the_whole_update_back(monkeypatch):
    """The first minibatches' steps were finite and applied; the fifth one's value loss is NaN: the weights and
    Adam's moments go back to what they were before the update, and the next update trains normally."""
    learner, fragment = _learner_and_fragment()
    before = _weights(learner)
    optimizer_before = learner.optimizer.state_dict()["state"]
    assert optimizer_before == {}  # no step taken yet
    calls = []
    value_loss = ppo.value_loss

    def nan_on_fifth(*args, **kwargs):
        calls.append(1)
        loss = value_loss(*args, **kwargs)
        return loss * float("nan") if len(calls) == 5 else loss

    monkeypatch.setattr(ppo, "value_loss", nan_on_fifth)
    out = learner.update([fragment])
    assert out["update_skipped"] == 1.0
    assert out["skip_reason"].startswith("the loss is nan (policy_loss ")
    assert out["skip_reason"].endswith("value_loss nan, entropy 0.693) at epoch 2, minibatch 1")
    for key, value in learner.model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    assert learner.optimizer.state_dict()["state"] == {}
    monkeypatch.setattr(ppo, "value_loss", value_loss)
    out = learner.update([fragment])
    assert out["update_skipped"] == 0.0 and np.isfinite(out["policy_loss"])
    assert any(not torch.equal(v, before[k]) for k, v in learner.model.state_dict().items())


# -- runs ------------------------------------------------------------------------------------------------------


def _config(field: str, after: int, marker: str | None = None, normalize_reward: bool = True, **training):
    kwargs = {"field": field, "after": after, "marker": marker, "length": 100}
    return config_from_dict(
        {
            "env": {"id": "test_nonfinite/bad-after", "kwargs": kwargs},
            "ppo": {"normalize_obs": True, "normalize_reward": normalize_reward},
            "runners": {"sample_timeout_s": 20.0},
            "training": {"total_env_steps": 2048, "eval_episodes": 0, "checkpoint_every": 1, **training},
        }
    )


def _checkpoint_tensors(run_dir: Path) -> list[tuple[str, dict]]:
    return [
        (path.name, torch.load(path, weights_only=False)) for path in sorted((run_dir / "checkpoints").glob("*.pt"))
    ]


def _all_finite(state: dict) -> bool:
    learner = state["learner"]
    stats = [np.asarray(learner[k][part]) for k in ("obs_stats", "return_stats") for part in ("mean", "m2")]
    return all(torch.isfinite(v).all() for v in learner["model"].values()) and all(np.isfinite(s).all() for s in stats)


def test_one_nan_reward_costs_one_fragment_and_nothing_else(local_ray, tmp_path, train):
    summary, rows = train(_config("reward", after=60, marker=str(tmp_path / "marker")), tmp_path / "run")
    assert (tmp_path / "marker").exists()  # the NaN really came
    assert summary["runner_restarts"] == 1 and summary["lost_fragments"] == 1
    assert "non-finite reward (nan) at step 60 of an episode" in summary["runner_failures"][0]
    assert "'test_nonfinite/bad-after'" in summary["runner_failures"][0]
    assert np.isfinite(summary["episode_return_mean"])
    assert all(r["policy_loss"] is not None and r["update_skipped"] == 0 for r in rows)
    assert summary["skipped_updates"] == 0
    assert all(_all_finite(state) for _, state in _checkpoint_tensors(tmp_path / "run"))


@pytest.mark.parametrize(
    "after, how",
    [
        (20, f"failed {MAX_CONSECUTIVE_FAILURES + 1} times in a row"),  # within every fragment (32 steps)
        # in a runner's second fragment: each replacement's first one succeeds, so it fails every other sample
        (50, f"failed {FAILURE_WINDOW // 2} of its last {FAILURE_WINDOW} samples"),
    ],
)
def test_an_env_whose_observations_turn_nan_stops_the_run_naming_it(local_ray, tmp_path, after, how):
    trainer = Trainer(_config("obs", after=after, total_env_steps=100_000), tmp_path / "run", quiet=True)
    try:
        with pytest.raises(RunAbortedError) as info:
            trainer.train()
    finally:
        trainer.close()
    message = str(info.value)
    assert how in message
    said = f"env 'test_nonfinite/bad-after' returned a non-finite observation (nan at index 0) at step {after} "
    assert said in message
    assert "\n" not in message
    saved = _checkpoint_tensors(tmp_path / "run")
    assert saved and all(_all_finite(state) for _, state in saved)


def test_updates_that_are_never_finite_stop_the_run_and_keep_the_good_weights(local_ray, tmp_path):
    """A reward of 3e38 is finite, so the runner passes it, but no advantage over it is: every update is
    skipped, counted, and after a few in a row the run stops; the checkpoints hold the initial weights."""
    run_dir = tmp_path / "run"
    trainer = Trainer(_config("huge_reward", after=1, normalize_reward=False), run_dir, quiet=True)
    try:
        with pytest.raises(RunAbortedError, match=f"^the learner skipped {MAX_SKIPPED_UPDATES} updates in a row"):
            trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_updates"] for r in rows] == list(range(1, MAX_SKIPPED_UPDATES + 1))
    assert all(r["update_skipped"] == 1 and r["policy_loss"] is None for r in rows)
    saved = _checkpoint_tensors(run_dir)
    assert saved and all(_all_finite(state) for _, state in saved)
    first, last = saved[0][1]["learner"]["model"], saved[-1][1]["learner"]["model"]
    assert all(torch.equal(first[k], last[k]) for k in first)  # nothing was ever applied
    assert saved[-1][1]["progress"]["skipped_updates"] == MAX_SKIPPED_UPDATES


def test_cli_run_on_an_env_that_turns_nan_exits_1_with_one_line(tmp_path):
    (tmp_path / "nan_envs.py").write_text(
        "import rlfabric\nfrom test_ppo_nonfinite import BadAfter\n\n"
        "rlfabric.register_env('nan-obs', lambda: BadAfter('obs', after=30))\n"
    )
    tests = Path(__file__).resolve().parent
    out = subprocess.run(
        [sys.executable, "-m", "rlfabric.cli", "train", "algo=ppo", "env.id=nan-obs", "training.total_env_steps=2048",
         "training.eval_episodes=0", "--import", "nan_envs", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": f"{tmp_path}:{tests}"},
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-2000:]
    stopped = [line for line in out.stderr.splitlines() if line.startswith("rlfabric: run stopped:")]
    assert len(stopped) == 1, out.stderr[-3000:]
    assert "env 'nan-obs' returned a non-finite observation (nan at index 0) at step 30 of an episode" in stopped[0]
