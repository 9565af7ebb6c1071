"""The GRPO family's named parts: one table per kind, read by config validation, the docs and the learner's math."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlfabric.algorithms import grpo
from rlfabric.algorithms.lr_schedules import scheduled_lr
from rlfabric.config import ConfigError, config_from_dict
from rlfabric.objectives import ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS, LR_SCHEDULES, TABLES

CONFIG_DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.field)
def test_every_name_resolves_to_a_function_with_its_formula(table):
    for part in table.parts():
        function = table.resolve(part.name)
        assert callable(function) and "=" in (function.__doc__ or ""), f"{part.target}: no formula in the docstring"


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.field)
def test_config_validation_names_the_field_and_the_registered_names(table):
    section, key = table.field.split(".")
    with pytest.raises(ConfigError) as info:
        config_from_dict({"algo": "grpo", section: {key: "no_such_part"}})
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{table.field} = 'no_such_part' is not valid")
    assert all(name in message for name in table.names())


def test_a_misspelt_name_gets_the_closest_one():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"algo": "grpo", "grpo": {"advantage": "rlo"}})
    assert str(info.value).startswith("grpo.advantage = 'rlo' is not valid (did you mean 'rloo'?): must be one of ")


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.field)
def test_the_config_reference_lists_every_name(table):
    row = next(line for line in CONFIG_DOC.read_text().splitlines() if line.startswith(f"| `{table.field}` |"))
    assert [name for name in table.names() if f"`{name}`" not in row] == []


def test_a_registered_estimator_is_valid_config_and_runs_in_the_math():
    ADVANTAGE_ESTIMATORS.add("leave_one_out", "rlfabric.algorithms.grpo:rloo_advantages", "RLOO under another name")
    try:
        cfg = config_from_dict({"algo": "grpo", "grpo": {"advantage": "leave_one_out"}})
        assert cfg.grpo.advantage == "leave_one_out"
        rewards, groups = torch.tensor([1.0, 0.0, 0.0, 2.0]), torch.tensor([0, 0, 1, 1])
        # RLOO by hand: r_i minus the mean of the others in its group.
        expected = torch.tensor([1.0, -1.0, -2.0, 2.0])
        torch.testing.assert_close(grpo.compute_advantages("leave_one_out", rewards, groups), expected)
    finally:
        ADVANTAGE_ESTIMATORS.remove("leave_one_out")
    with pytest.raises(ConfigError, match="grpo.advantage = 'leave_one_out' is not valid"):
        config_from_dict({"algo": "grpo", "grpo": {"advantage": "leave_one_out"}})


def train_in(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """``rlfabric train ARGS`` in a fresh process whose current directory is ``folder``, the user's modules there
    and nowhere else on the path, on a local Ray instance of its own."""
    return subprocess.run(
        [sys.executable, "-m", "rlfabric.cli", "train", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": "", "RAY_ADDRESS": ""},
    )


MEDIAN_BASELINE = """
import os

import torch

from rlfabric.objectives import ADVANTAGE_ESTIMATORS


def median_baseline(rewards, group_ids, *, scale_by_std=True):
    \"\"\"A_i = r_i - median of r over i's group.\"\"\"
    with open({calls!r}, "a") as calls:
        calls.write(f"{{os.getpid()}}\\n")
    out = torch.zeros(rewards.shape, dtype=torch.float32)
    for group in torch.unique(group_ids):
        rows = group_ids == group
        out[rows] = rewards[rows].float() - rewards[rows].float().median()
    return out


ADVANTAGE_ESTIMATORS.add("median", "median_adv:median_baseline", "reward minus its group's median")
"""


def test_an_estimator_a_users_module_adds_is_the_one_the_learner_runs(tmp_path):
    """Added by a module of the current directory given to --import: the learner and the reference are other
    processes, which never imported that module; the driver's addition reaches them with the function."""
    calls = tmp_path / "calls"
    (tmp_path / "median_adv.py").write_text(MEDIAN_BASELINE.format(calls=str(calls)))
    overrides = [
        "model.builtin={num_layers: 1, hidden_size: 32, num_heads: 2, max_positions: 64}",
        "sft.steps=0",
        "data.num_eval=4",
        "training.total_steps=2",
        "grpo.advantage=median",
        "grpo.kl_coef=0.05",  # with a reference actor: it builds the learner's batch, advantages and all
        "grpo.reference=actor",
    ]
    done = train_in(tmp_path, *overrides, "--import", "median_adv", "--run-dir", "run")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    assert len(set(calls.read_text().split())) == 2  # in the learner's process and the reference's


def test_an_estimator_whose_module_fails_to_load_is_one_line_before_ray_starts(tmp_path):
    """A module of the current directory that registers a target in a module that raises on import: the run
    stops before its actors start, naming the field and the error (not at the learner's first update)."""
    (tmp_path / "adv_register.py").write_text(
        "from rlfabric.objectives import ADVANTAGE_ESTIMATORS\n"
        'ADVANTAGE_ESTIMATORS.add("mine", "adv_impl:mine", "needs a package this machine lacks")\n'
    )
    (tmp_path / "adv_impl.py").write_text("import no_such_package_here\n")
    done = train_in(tmp_path, "grpo.advantage=mine", "--import", "adv_register")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "rlfabric: config error: grpo.advantage = 'mine': its function 'adv_impl:mine' does not load: "
        "ModuleNotFoundError: No module named 'no_such_package_here'"
    )
    assert "Started a local Ray instance" not in done.stderr


def test_aggregation_denominators_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])  # the middle row is all masked
    loss = torch.tensor([[1.0, 3.0, 9.0], [5.0, 5.0, 5.0], [4.0, 9.0, 9.0]])
    expected = {"token_mean": (8.0, 3.0), "seq_mean_token_mean": (6.0, 2.0), "seq_mean_token_sum_norm": (2.0, 2.0)}
    for name, (numerator, denominator) in expected.items():
        got_numerator, got_denominator = LOSS_AGGREGATIONS.resolve(name)(loss, mask, 4)
        assert (float(got_numerator), got_denominator) == (numerator, denominator), name
        assert grpo.aggregate_denominator(mask, name, 4) == denominator


def test_a_bad_target_is_refused_when_added():
    with pytest.raises(ValueError, match="must be 'package.module:function'"):
        ADVANTAGE_ESTIMATORS.add("broken", "rlfabric.algorithms.grpo.rloo_advantages", "no colon")


@pytest.mark.parametrize(
    "schedule, expected",
    [  # lr 1.0, T = 10 steps, W = 2 warm-up steps (0.5, 1.0), then the schedule at t = 2, 6, 9
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 1.0, 0.5, 0.125]),  # 1 - (t - 2) / 8
        ("cosine", [0.5, 1.0, 1.0, 0.5, 0.0380602]),  # (1 + cos(pi (t - 2) / 8)) / 2
    ],
)
def test_learning_rate_schedules_by_hand(schedule, expected):
    shape = LR_SCHEDULES.resolve(schedule)

    def lr_at(lr: float, step: int, total_steps: int, warmup_steps: int) -> float:
        return scheduled_lr(shape, lr, step, total_steps, warmup_steps)

    got = [lr_at(1.0, t, 10, 2) for t in (0, 1, 2, 6, 9)]
    assert got == pytest.approx(expected, abs=1e-6)
    assert [lr_at(2.0, t, 4, 0) for t in range(4)] == pytest.approx(
        {"constant": [2.0] * 4, "linear": [2.0, 1.5, 1.0, 0.5], "cosine": [2.0, 1.7071068, 1.0, 0.2928932]}[schedule]
    )
    # past the end (a step beyond the total): never negative, never rising again
    assert lr_at(1.0, 12, 10, 2) == pytest.approx({"constant": 1.0, "linear": 0.0, "cosine": 0.0}[schedule])


def test_a_warm_up_as_long_as_the_run_is_refused_where_the_rate_should_decay():
    grpo = {"algo": "grpo", "training": {"total_steps": 10}}
    for schedule in ("linear", "cosine"):
        with pytest.raises(ConfigError, match=r"^grpo.warmup_steps = 10 is not valid: must be < training.total_st"):
            config_from_dict({**grpo, "grpo": {"warmup_steps": 10, "lr_schedule": schedule}})
    assert config_from_dict({**grpo, "grpo": {"warmup_steps": 9}}).grpo.warmup_steps == 9
    assert config_from_dict({**grpo, "grpo": {"warmup_steps": 10, "lr_schedule": "constant"}}).grpo.warmup_steps == 10
