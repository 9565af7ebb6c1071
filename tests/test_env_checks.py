"""The env checks before Ray starts: one reset and one step against the Gymnasium API in the driver's pre-start
check (``rlfabric train``) and in ``rlfabric envs check``, each failure one line naming the env."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import ray

import rlfabric
from rlfabric.cli import main


class PointReach(gym.Env):
    """A 2-d point env; ``flaw`` breaks one part of the Gymnasium API."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def __init__(self, flaw: str = "") -> None:
        self.flaw = flaw

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        obs = np.zeros(2, np.float32)
        return obs if self.flaw == "old_reset" else (obs, {})

    def step(self, action):
        obs = np.zeros(3 if self.flaw == "step_shape" else 2, np.float32)
        reward = float("nan") if self.flaw == "nan_reward" else 0.0
        if self.flaw == "old_step":
            return obs, reward, False, {}
        return obs, reward, False, False, {}


for flaw in ("old_reset", "step_shape", "nan_reward", "old_step"):
    rlfabric.register_env(f"point-{flaw.replace('_', '-')}", lambda flaw=flaw: PointReach(flaw))


@pytest.mark.parametrize(
    "env_id, says",
    [
        ("point-old-reset", "reset() returned a ndarray, not (observation, info)"),
        ("point-step-shape", "step()'s observation has shape (3,); the observation space"),
        ("point-nan-reward", "step()'s reward is nan, not a finite scalar"),
        ("point-old-step", "step() returned 4 values, not the 5 values"),
    ],
)
def test_train_refuses_an_env_off_the_gymnasium_api_before_ray(env_id, says, no_ray, tmp_path, capsys):
    code = main(["train", "algo=ppo", f"env.id={env_id}", "--run-dir", str(tmp_path / "r"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith(f"rlfabric: config error: env.id = {env_id!r}: {says}")
    assert len(err.splitlines()) == 1
    assert not ray.is_initialized()


def test_envs_check_fails_an_observation_of_the_wrong_shape(capsys):
    assert main(["envs", "check", "point-step-shape"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL point-step-shape: step()'s observation has shape (3,)")


def test_a_well_behaved_env_passes_both(no_ray, capsys):
    rlfabric.register_env("point-fine", PointReach)
    assert main(["envs", "check", "point-fine"]) == 0
    assert capsys.readouterr().out.startswith("OK point-fine")
