"""A new PPO run from another run's checkpoint (``model.init_from``): its weights and normalizer statistics, with
a fresh optimizer and counters; a bad checkpoint is one line, before Ray where that can be known."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from rlfabric.cli import main
from rlfabric.config import ConfigError
from rlfabric.config import ppo_config_from_dict as config_from_dict
from rlfabric.driver import Trainer, latest_checkpoint


def _config(**sections) -> dict:
    cfg = {
        "env": {"id": "gym:CartPole-v1"},
        "runners": {"num_runners": 1, "envs_per_runner": 2},
        "ppo": {"train_batch_size": 256, "minibatch_size": 128, "num_epochs": 2},
        "model": {"hidden_sizes": [16]},
        "training": {"total_env_steps": 512, "eval_episodes": 0},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """A short CartPole run whose checkpoints the tests start from."""
    run_dir = tmp_path_factory.mktemp("first") / "run"
    trainer = Trainer(config_from_dict(_config()), run_dir, quiet=True)
    try:
        trainer.train()
    finally:
        trainer.close()
    return run_dir


def test_a_new_run_starts_from_the_checkpoints_weights_and_statistics_with_its_own_optimizer(
    local_ray, first_run, tmp_path
):
    saved = torch.load(latest_checkpoint(first_run), weights_only=False)["learner"]
    cfg = config_from_dict(_config(model={"init_from": str(first_run)}, training={"total_env_steps": 256}))
    trainer = Trainer(cfg, tmp_path / "second", quiet=True)
    try:
        trainer.setup()
        start = ray.get(trainer.learner.state.remote())
        summary = trainer.train()
    finally:
        trainer.close()
    for name, value in saved["model"].items():
        assert torch.equal(start["model"][name], value), name
    for stats in ("obs_stats", "return_stats", "value_stats"):
        assert start[stats].keys() == saved[stats].keys()
        for key, value in saved[stats].items():
            np.testing.assert_array_equal(start[stats][key], value, err_msg=f"{stats}.{key}")
    assert saved["obs_stats"]["count"] >= 512  # the first run's observations, not a fresh normalizer's
    assert start["optimizer"]["state"] == {} and start["version"] == 0 and start["updates_done"] == 0
    assert summary["env_steps"] == 256  # its own counters: one batch, not the first run's 512 and more


@pytest.mark.parametrize(
    "init_from, model, says",
    [
        ("no_such_run", {}, "model.init_from = 'no_such_run': no such file or run directory"),
        ("EMPTY", {}, "the folder holds no PPO checkpoint (checkpoints/iter_*.pt)"),
        (
            "FIRST",
            {"hidden_sizes": [8]},
            "its network has model.hidden_sizes = [16], this run's model.hidden_sizes "
            "is [8]; set it to the checkpoint's",
        ),
    ],
)
def test_a_bad_checkpoint_is_one_line_before_ray(init_from, model, says, first_run, tmp_path, no_ray, capsys):
    (tmp_path / "empty").mkdir()
    value = {"EMPTY": str(tmp_path / "empty"), "FIRST": str(first_run)}.get(init_from, init_from)
    args = ["train", "algo=ppo", "env.id=gym:CartPole-v1", f"model.init_from={value}"]
    args += [f"model.hidden_sizes={model['hidden_sizes']}"] if model else ["model.hidden_sizes=[16]"]
    assert main([*args, "--run-dir", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlfabric: config error: model.init_from = ") and err.endswith(says), err
    assert len(err.splitlines()) == 1 and not ray.is_initialized()


def test_an_env_whose_spaces_differ_from_the_checkpoints_is_one_line(local_ray, first_run, tmp_path):
    cfg = config_from_dict(_config(env={"id": "gym:Acrobot-v1"}, model={"init_from": str(first_run)}))
    trainer = Trainer(cfg, tmp_path / "other", quiet=True)
    try:
        with pytest.raises(ConfigError) as info:
            trainer.setup()
    finally:
        trainer.close()
    assert str(info.value).startswith(f"model.init_from = {str(latest_checkpoint(first_run))!r}: its ")
    assert str(info.value).endswith(
        "the env's observation or action space is not the one the checkpoint was trained on"
    )
