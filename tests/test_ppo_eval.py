"""``rlfabric eval`` on a PPO run: a tiny CartPole run's checkpoint played through the CLI (run directory and
checkpoint file), its report, the observation statistics it holds, and the public policy API."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rlfabric.cli import main
from rlfabric.ppo_eval import env_action, load_policy


@pytest.fixture(scope="module")
def ppo_run(local_ray, tmp_path_factory) -> Path:
    """A two-iteration PPO run on CartPole with observation normalization, through the CLI."""
    run_dir = tmp_path_factory.mktemp("ppo_eval") / "run"
    code = main(
        [
            "train",
            "algo=ppo",
            "env.id=gym:CartPole-v1",
            "ppo.normalize_obs=true",
            "runners.num_runners=1",
            "training.total_env_steps=512",
            "training.eval_episodes=0",
            "--run-dir",
            str(run_dir),
            "--quiet",
        ]
    )
    assert code == 0
    return run_dir


def test_eval_of_a_run_dir_plays_episodes_and_writes_the_report(ppo_run, capsys):
    assert main(["eval", "--run-dir", str(ppo_run), "--episodes", "3", "--seed", "5"]) == 0
    printed = capsys.readouterr().out
    checkpoint = sorted((ppo_run / "checkpoints").glob("iter_*.pt"))[-1]
    report = json.loads((ppo_run / "eval" / f"{checkpoint.stem}.json").read_text())
    assert report["checkpoint"] == str(checkpoint) and report["env"] == "gym:CartPole-v1"
    assert report["episodes"] == 3 and len(report["episode_returns"]) == 3
    assert report["actions"] == "deterministic"
    assert report["return_mean"] == pytest.approx(np.mean(report["episode_returns"]))
    assert report["episode_lengths"] == [int(r) for r in report["episode_returns"]]  # CartPole: +1 a step
    assert "return" in printed and str(ppo_run / "eval") in printed


def test_eval_of_a_checkpoint_file_samples_when_asked(ppo_run, tmp_path, capsys):
    checkpoint = sorted((ppo_run / "checkpoints").glob("iter_*.pt"))[-1]
    args = ["eval", "--checkpoint", str(checkpoint), "--episodes", "2", "--sample", "--out", str(tmp_path)]
    assert main(args) == 0
    report = json.loads((tmp_path / f"{checkpoint.stem}.json").read_text())
    assert report["actions"] == "sampled" and report["episodes"] == 2


def test_loaded_policy_uses_the_checkpoints_statistics_and_acts_on_its_env(ppo_run):
    policy = load_policy(ppo_run)
    assert policy.policy.normalizer is not None  # ppo.normalize_obs: the statistics travel with the checkpoint
    env = policy.make_env()
    obs, _ = env.reset(seed=0)
    first = policy.act(obs)
    assert first in (0, 1) and policy.act(obs) == first  # deterministic: the argmax, every time
    obs, reward, *_ = env.step(env_action(env.action_space, first))
    assert reward == 1.0
    env.close()


def test_eval_of_a_run_without_checkpoints_says_so_in_ppo_terms(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("algo: ppo\nenv:\n  id: gym:CartPole-v1\n")
    assert main(["eval", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint under checkpoints/" in err and "final_model" not in err
