"""Run folders, through the public CLI: a folder holding only a run's ``initial`` evaluation is reused, not
refused; ``train-rm`` on bad input leaves no new folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from grpo_runs import BASE, merged

from rlfabric.cli import main
from rlfabric.config import Config, ConfigError, config_from_dict, dump_config
from rlfabric.driver import Trainer
from rlfabric.llm_driver import GRPOTrainer
from rlfabric.run.log import read_metrics

INITIAL_ROW = {"iteration": 0, "step": 0, "policy_version": 0, "phase": "eval", "label": "initial"}


def write_config(path: Path, **sections: dict) -> Path:
    """BASE (a tiny builtin model) with ``sections`` merged in, as a config file for the CLI."""
    path.write_text(dump_config(config_from_dict(merged(BASE, sections))))
    return path


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, list[str]]:
    """``rlfabric <argv>`` in this process: (exit code, stdout, stderr lines)."""
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def config_errors(err: list[str]) -> list[str]:
    return [line for line in err if line.startswith("rlfabric: config error:")]


# -- (a) a folder with only the initial evaluation is reused ----------------------------------------------------


@pytest.mark.parametrize("trainer", ["grpo", "ppo"])
def test_evaluation_and_reward_model_rows_are_not_training_rows(trainer, tmp_path):
    """Only a training row (GRPO's sft and grpo rows, PPO's iteration rows, which have no phase) makes a folder a
    run that a new one must not write over; evaluation and reward-model rows do not."""

    def new_run() -> object:
        return GRPOTrainer(config_from_dict(BASE), tmp_path) if trainer == "grpo" else Trainer(Config(), tmp_path)

    metrics = tmp_path / "metrics.jsonl"
    for rows in (
        [INITIAL_ROW],
        [{"phase": "rm", "rm_step": 10}, {"phase": "rm_eval", "rm_step": 10}, INITIAL_ROW],
    ):
        metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
        new_run()  # reused: nothing was trained there
    refused = f"--run-dir {str(tmp_path)!r} already holds a run (it has no checkpoint to resume): choose another "
    for row in (
        {"phase": "sft", "sft_step": 1},
        {"phase": "grpo", "step": 1},
        {"iteration": 1, "env_steps": 512},  # PPO's and games' rows
    ):
        metrics.write_text(json.dumps(INITIAL_ROW) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(ConfigError) as info:
            new_run()
        assert str(info.value) == refused + "directory or delete it", row


def test_the_same_command_reruns_in_a_folder_a_run_left_after_its_initial_evaluation(local_ray, tmp_path, capsys):
    """A run that stopped after its first evaluation (its folder: config, initial model, the ``initial`` row) is
    started again by the same command, and its metrics begin anew."""
    config = write_config(tmp_path / "run.yaml", training={"total_steps": 1})
    run_dir = tmp_path / "runs" / "t1"
    first = GRPOTrainer(config_from_dict(merged(BASE, {"training": {"total_steps": 1}})), run_dir, quiet=True)
    try:
        first.setup()
        first.evaluate("initial")
    finally:
        first.close()
    assert [row["label"] for row in read_metrics(run_dir)] == ["initial"]

    code, out, err = run_cli(["train", str(config), "--run-dir", str(run_dir), "--quiet"], capsys)
    assert code == 0, err
    assert f"rlfabric: GRPO on {BASE['data']['train']} -> {run_dir} (new run)" in err
    rows = read_metrics(run_dir)
    assert [(r["phase"], r.get("label")) for r in rows] == [("eval", "initial"), ("grpo", None), ("eval", "final")]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1
    # now it trained: the same command is refused
    code, out, err = run_cli(["train", str(config), "--run-dir", str(run_dir), "--quiet"], capsys)
    assert code == 2 and config_errors(err) == [
        f"rlfabric: config error: --run-dir {str(run_dir)!r} already holds a run (it has no checkpoint to resume): "
        "choose another directory or delete it"
    ]


# -- (d) train-rm on bad input leaves no folder -------------------------------------------------------------------


def test_train_rm_on_pairs_without_their_columns_leaves_no_new_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"a": "1+1=", "b": "2"}) + "\n" for _ in range(4)))
    argv = ["train-rm", f"reward_model.pairs={pairs}", "model.builtin.num_layers=1", "model.builtin.hidden_size=32"]
    code, out, err = run_cli([*argv, "--run-dir", str(tmp_path / "runs" / "rm1"), "--quiet"], capsys)
    assert code == 2, err
    assert config_errors(err) == err[-1:], err
    assert err[-1].startswith(f"rlfabric: config error: reward_model.pairs = {str(pairs)!r}: "), err
    assert not (tmp_path / "runs").exists()
    # a folder that was there before is kept (what is in it is not this run's to remove)
    (tmp_path / "runs").mkdir()
    code, out, err = run_cli([*argv, "--run-dir", str(tmp_path / "runs" / "rm1"), "--quiet"], capsys)
    assert code == 2, err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == []
