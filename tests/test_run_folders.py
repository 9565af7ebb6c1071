"""Run folders, through the public CLI: a folder holding only a run's ``initial`` evaluation is reused, not
refused; a run records the modules it was started with (``--import``) and ``train --resume`` and ``eval
--run-dir`` import them again; ``eval`` keeps the earlier report it finds in its output folder; ``train-rm`` on
bad input leaves no new folder."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from grpo_runs import BASE, merged

from rlfabric import registry as env_registry
from rlfabric.cli import main
from rlfabric.config import Config, ConfigError, config_from_dict, dump_config
from rlfabric.driver import Trainer
from rlfabric.evaluation import keep_earlier_report
from rlfabric.llm_driver import GRPOTrainer
from rlfabric.llm_run_state import latest_checkpoint
from rlfabric.rewards import registry as reward_registry
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


# -- (b) a run's --import modules are recorded and imported again -------------------------------------------------

REWARD_MODULE = '''
from rlfabric.rewards import register_reward


def doubled(inputs):
    """correct = 2 for the right sum (the arithmetic rows' answer), else 0."""
    return [{{"correct": 2.0 * float(x.completion.strip() == x.metadata["answer"])}} for x in inputs]


register_reward({name!r}, doubled)
'''


@pytest.fixture(scope="module")
def imported_run(tmp_path_factory, local_ray):
    """A GRPO run of one step (a checkpoint at it) on a reward registered by a module in the current directory,
    started with ``--import``: (that directory, the run folder, the module, the reward's name)."""
    folder = tmp_path_factory.mktemp("imported")
    module = f"run_folder_rewards_{os.getpid()}_{time.monotonic_ns()}"
    name = f"doubled_{module}"
    (folder / f"{module}.py").write_text(REWARD_MODULE.format(name=name))
    config = write_config(
        folder / "run.yaml",
        rewards={"functions": [{"name": name}]},
        training={"total_steps": 1, "checkpoint_every": 1},
    )
    run_dir = folder / "runs" / "c1"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setattr(sys, "path", list(sys.path))
        patch.setattr(reward_registry, "_REGISTRY", dict(reward_registry._REGISTRY))
        assert main(["train", str(config), "--import", module, "--run-dir", str(run_dir), "--quiet"]) == 0
    sys.modules.pop(module, None)
    return folder, run_dir, module, name


@pytest.fixture
def as_a_new_process(imported_run, monkeypatch):
    """In the run's directory, with its module neither imported nor registered, as in a new ``rlfabric``."""
    folder, _, module, name = imported_run
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(reward_registry, "_REGISTRY", dict(reward_registry._REGISTRY))
    reward_registry._REGISTRY.pop(name, None)
    sys.modules.pop(module, None)
    yield
    sys.modules.pop(module, None)


def test_a_run_records_the_modules_it_imported_beside_its_config(imported_run):
    _, run_dir, module, _ = imported_run
    assert (run_dir / "imports.txt").read_text() == f"{module}\n"
    assert (run_dir / "config.yaml").is_file()


def test_resume_imports_the_runs_modules_again(imported_run, as_a_new_process, capsys):
    _, run_dir, module, name = imported_run
    code, _, err = run_cli(["train", "--resume", str(run_dir), "training.total_steps=2", "--quiet"], capsys)
    assert code == 0, err
    assert name in reward_registry._REGISTRY
    assert [r["step"] for r in read_metrics(run_dir) if r["phase"] == "grpo"] == [1, 2]
    # given again with --import: imported once, recorded once
    sys.modules.pop(module)
    reward_registry._REGISTRY.pop(name)
    code, _, err = run_cli(
        ["train", "--resume", str(run_dir), "--import", module, "training.total_steps=3", "--quiet"], capsys
    )
    assert code == 0, err
    assert (run_dir / "imports.txt").read_text() == f"{module}\n"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3


def test_eval_of_the_run_imports_its_modules_and_keeps_the_earlier_report(imported_run, as_a_new_process, capsys):
    """(c) too: a second evaluation into the same folder moves the first report to ``eval-1`` beside it, a third
    the second to ``eval-2``, and each says so; a checkpoint's reports inside ``eval/`` stay where they are."""
    _, run_dir, _, name = imported_run
    out = run_dir / "eval"
    argv = ["eval", "--run-dir", str(run_dir), "--n", "1,2", "--quiet"]
    code, stdout, err = run_cli([*argv, "--num-prompts", "2"], capsys)
    assert code == 0, err
    assert name in reward_registry._REGISTRY
    assert f"  report           {out / 'eval.json'}" in stdout.splitlines()
    assert not any("earlier report" in line for line in err), err
    first = json.loads((out / "eval.json").read_text())
    assert first["prompts"] == 2

    checkpoint = latest_checkpoint(run_dir)  # (another test may have resumed the run)
    assert checkpoint is not None
    code, _, err = run_cli(["eval", "--checkpoint", str(checkpoint), "--n", "1", "--num-prompts", "1"], capsys)
    assert code == 0, err
    assert json.loads((out / checkpoint.name / "eval.json").read_text())["prompts"] == 1

    code, _, err = run_cli([*argv, "--num-prompts", "3"], capsys)
    assert code == 0, err
    assert f"rlfabric eval: the earlier report in {out} was moved to {run_dir / 'eval-1'}" in err
    kept = run_dir / "eval-1"
    assert sorted(p.name for p in kept.iterdir()) == [
        "best_of_n.png",
        "eval.json",
        "reward_vs_length.png",
        "samples.jsonl",
    ]
    earlier = json.loads((kept / "eval.json").read_text())
    assert earlier == {**first, "files": {key: str(kept / Path(path).name) for key, path in first["files"].items()}}
    assert len((kept / "samples.jsonl").read_text().splitlines()) == 2 * 2
    assert json.loads((out / "eval.json").read_text())["prompts"] == 3
    assert len((out / "samples.jsonl").read_text().splitlines()) == 3 * 2
    assert json.loads((out / checkpoint.name / "eval.json").read_text())["prompts"] == 1  # not moved

    code, _, err = run_cli([*argv, "--num-prompts", "1"], capsys)
    assert code == 0, err
    assert f"rlfabric eval: the earlier report in {out} was moved to {run_dir / 'eval-2'}" in err
    assert json.loads((run_dir / "eval-2" / "eval.json").read_text())["prompts"] == 3
    assert json.loads((run_dir / "eval-1" / "eval.json").read_text())["prompts"] == 2


def test_an_earlier_report_moves_to_the_first_free_numbered_folder_beside_its_own(tmp_path, monkeypatch):
    """Only the report's files move (a checkpoint's reports and a builtin model in the folder stay), to ``-1``, then
    ``-2``; its eval.json's files point where they went. A folder without a report keeps nothing."""
    out = tmp_path / "eval"
    (out / "step_000002").mkdir(parents=True)
    (out / "initial_model").mkdir()
    assert keep_earlier_report(out) is None and not (tmp_path / "eval-1").exists()
    for k in (1, 2):
        files = {"samples": str(out / "samples.jsonl"), "elsewhere": str(tmp_path / "x.png")}
        (out / "eval.json").write_text(json.dumps({"prompts": k, "files": files}))
        for name in ("samples.jsonl", "best_of_n.png", "reward_vs_length.png"):
            (out / name).write_text(f"{name} {k}")
        assert keep_earlier_report(out) == tmp_path / f"eval-{k}"
    assert sorted(p.name for p in out.iterdir()) == ["initial_model", "step_000002"]
    for k in (1, 2):
        kept = tmp_path / f"eval-{k}"
        assert json.loads((kept / "eval.json").read_text()) == {
            "prompts": k,
            "files": {"samples": str(kept / "samples.jsonl"), "elsewhere": str(tmp_path / "x.png")},
        }
        assert (kept / "best_of_n.png").read_text() == f"best_of_n.png {k}"
    monkeypatch.chdir(out)  # --out .: numbered beside the current directory
    (out / "samples.jsonl").write_text("")
    assert keep_earlier_report(Path(".")) == tmp_path / "eval-3"


def test_a_recorded_module_that_cannot_be_imported_is_one_line(
    imported_run, as_a_new_process, tmp_path, monkeypatch, capsys
):
    """From another directory, the run's module is not found: one line naming it, the run and its record."""
    _, run_dir, module, _ = imported_run
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    not_found = (
        f"the run was started with --import {module} ({run_dir / 'imports.txt'}): no such module in the current "
        f"directory ({elsewhere}) or on the Python path"
    )
    code, out, err = run_cli(["train", "--resume", str(run_dir), "training.total_steps=9"], capsys)
    assert (code, out, err) == (2, "", [f"rlfabric: config error: --resume {str(run_dir)!r}: {not_found}"])
    code, out, err = run_cli(["eval", "--run-dir", str(run_dir)], capsys)
    assert (code, out, err) == (2, "", [f"rlfabric: config error: --run-dir {str(run_dir)!r}: {not_found}"])
    checkpoint = str(latest_checkpoint(run_dir))
    code, out, err = run_cli(["eval", "--checkpoint", checkpoint], capsys)
    assert (code, out, err) == (2, "", [f"rlfabric: config error: --checkpoint {checkpoint!r}: {not_found}"])


def test_a_ppo_run_on_an_imported_env_resumes_with_its_module_imported_again(local_ray, cwd_env_module, capsys):
    module, name, _ = cwd_env_module
    small = ["runners.num_runners=1", "training.eval_episodes=1", "ppo.num_epochs=1", "--quiet"]
    argv = ["train", "algo=ppo", f"env.id={name}", "training.total_env_steps=256", *small, "--import", module]
    argv += ["--run-dir", "run"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert Path("run/imports.txt").read_text() == f"{module}\n"
    env_registry._REGISTRY.pop(name)  # as in a new process
    sys.modules.pop(module)
    code, _, err = run_cli(["train", "--resume", "run", "training.total_env_steps=512", *small], capsys)
    assert code == 0, err
    assert json.loads(Path("run/summary.json").read_text())["env_steps"] >= 512


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


def test_a_run_with_relative_paths_resumes_from_another_directory(local_ray, tmp_path, monkeypatch):
    """config.yaml records a local folder given relative to where the run started as an absolute path, so
    ``--resume`` works from elsewhere, and the same folder spelled absolute at resume is the same setting."""
    from rlfabric.models.hf import build_small_model_dir

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    build_small_model_dir(project / "mymodel", num_layers=1, hidden_size=32, num_heads=2)
    monkeypatch.chdir(project)
    cfg = config_from_dict(
        merged(BASE, {"model": {"path": "mymodel"}, "training": {"total_steps": 1, "checkpoint_every": 1}})
    )
    run = GRPOTrainer(cfg, project / "run", quiet=True)
    try:
        run.train()
    finally:
        run.close()
    monkeypatch.chdir(elsewhere)
    resumed = GRPOTrainer.from_run_dir(
        project / "run", ["training.total_steps=2", f"model.path={project / 'mymodel'}"], quiet=True
    )
    try:
        summary = resumed.train()
    finally:
        resumed.close()
    assert summary["steps"] == 2
