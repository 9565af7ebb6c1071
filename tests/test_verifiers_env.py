"""GRPO on environments written with the `verifiers` library's own API (``env.verifiers``), run unchanged in an
actor with the library installed (a Ray runtime env: verifiers pins mcp < 2): a SingleTurnEnv and a tool env
(StatefulToolEnv) roll out through the run's OpenAI-compatible endpoint, their rubric functions are the named
reward components, and what cannot work stops with one line."""

from __future__ import annotations

import logging

import pytest
import ray
from grpo_runs import BASE, example_stopped_by_config_error, merged, run_grpo

from rlfabric.config import ConfigError, config_from_dict
from rlfabric.llm_driver import GRPOTrainer
from rlfabric.llm_verifiers import accuracy_function

ARITHMETIC = {
    "model": {"builtin": {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "max_positions": 64}},
    "data": {"train": "env", "num_train": 16, "num_eval": 4},
    "env": {
        "verifiers": {
            "id": "rlfabric.envs.vf_arithmetic:load_environment",
            "args": {"num_train": 16, "num_eval": 4, "max_operand": 9},
        }
    },
    "rewards": {"functions": []},
    "sampling": {"max_new_tokens": 3},
    "training": {"total_steps": 2, "eval_every": 0, "show_samples": 2},
}


TOOL_MODEL = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "max_positions": 256}


def test_grpo_trains_on_a_verifiers_single_turn_env_with_its_rubric_as_components(local_ray, tmp_path):
    # beside the rubric, a reward function of the run's own: DAPO's length penalty, -L/3 for L <= 3 tokens here
    length = {"name": "length", "kwargs": {"max_tokens": 3, "cache_tokens": 3}}
    rewards = {"functions": [length], "weights": {"length_penalty": 0.5}}
    run = run_grpo(tmp_path / "run", **merged(ARITHMETIC, {"rewards": rewards}))
    steps = run.phase("grpo")
    assert len(steps) == 2 and sum(r["trained_rows"] for r in steps) > 0
    for r in steps:  # the rubric's functions, by name, and the run's; the reward is their weighted sum
        assert {"reward_exact_sum", "reward_digits_only"} <= set(r)
        assert -1.0 <= r["reward_length_penalty"] < 0  # every reply has at least its end token
        rubric = r["reward_exact_sum"] + 0.1 * r["reward_digits_only"]
        assert r["reward_mean"] == pytest.approx(rubric + 0.5 * r["reward_length_penalty"], abs=1e-5)
        assert r["turns_mean"] == 1.0 and r["rewrites"] == 0
    assert run.summary["failed_samples"] == 0  # an empty reply is the model's: scored, not failed
    evals = run.phase("eval")
    assert [e["label"] for e in evals] == ["initial", "final"] and all(e["eval_failed"] == 0 for e in evals)


def test_a_verifiers_tool_env_calls_its_tool_through_the_endpoint_after_a_warm_up(local_ray, tmp_path):
    run = run_grpo(
        tmp_path / "run",
        model={"builtin": {**TOOL_MODEL, "alphabet": "tool"}},
        data={"train": "env", "num_train": 64, "num_eval": 8},
        env={"verifiers": {"id": "rlfabric.envs.vf_key_lookup:load_environment", "args": {"num_train": 64}}},
        rewards={"functions": []},
        sampling={"max_new_tokens": 72},
        # each train row's episode played once through the library and reused: player and env are deterministic
        sft={
            "steps": 60,
            "batch_size": 16,
            "lr": 3e-3,
            "demonstrations": 64,
            "player": "rlfabric.envs.vf_key_lookup:lookup_player",
        },
        training={"total_steps": 1, "eval_every": 0, "show_samples": 0},
    )
    losses = [r["sft_loss"] for r in run.phase("sft")]
    assert losses[-1] < 0.5 * losses[0]  # the warm-up learns the library's episodes: call, then copy
    (step,) = run.phase("grpo")
    assert step["tool_calls"] > 0 and "reward_correct" in step  # the library ran the tool the model called


def trainer(tmp_path, **changes):
    return GRPOTrainer(config_from_dict(merged(merged(BASE, ARITHMETIC), changes)), tmp_path / "run", quiet=True)


def hosts_alive() -> list[str]:
    return [name for name in ray.util.list_named_actors() if name.startswith("rlfabric-verifiers-")]


@pytest.mark.parametrize(
    ("verifiers", "message"),
    [
        (
            {"id": "rlfabric.envs.vf_arithmetic:no_such_function"},
            "env.verifiers.id = 'rlfabric.envs.vf_arithmetic:no_such_function': loading it",
        ),
        (
            {"id": "rlfabric.envs.vf_arithmetic:load_environment", "accuracy": "right"},
            "env.verifiers.accuracy = 'right' is not valid: the rubric's functions are exact_sum, digits_only",
        ),
    ],
)
def test_an_environment_that_cannot_be_used_is_one_line_and_its_host_is_gone(local_ray, tmp_path, verifiers, message):
    t = trainer(tmp_path, env={"verifiers": {**ARITHMETIC["env"]["verifiers"], **verifiers}})
    with pytest.raises(ConfigError, match=message):
        t.setup()
    assert t.generators is None and hosts_alive() == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"data": {"train": "task:arithmetic"}}, "data.train = 'task:arithmetic' is not valid: must be 'env'"),
        ({"env": {"agent": "x"}}, "env.verifiers.id = .* is not valid: is exclusive with env.agent"),
        ({"sft": {"steps": 10}}, "sft.steps = 10 is not valid: needs sft.player with env.verifiers.id"),
        ({"data": {"eval": "task:arithmetic"}}, "data.eval = 'task:arithmetic' is not valid: must be ''"),
        (
            {"rewards": {"process": {"split": "newline"}}},
            "rewards.process.split = 'newline' is not valid: must be 'none' with env.verifiers.id",
        ),
    ],
)
def test_verifiers_settings_that_cannot_work_are_one_line_config_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(merged(merged(BASE, ARITHMETIC), changes))


def test_the_accuracy_function_is_the_one_named_or_the_first_weighted():
    weights = {"num_turns": 0.0, "exact_sum": 1.0, "digits_only": 0.1}
    assert accuracy_function(weights, "") == "exact_sum"
    assert accuracy_function(weights, "digits_only") == "digits_only"
    with pytest.raises(ConfigError, match="env.verifiers.accuracy = 'right' is not valid: the rubric's functions"):
        accuracy_function(weights, "right")


def test_the_librarys_line_for_each_empty_reply_is_dropped_and_its_other_errors_kept(caplog):
    from rlfabric.actors.verifiers_host import quiet_model_errors

    env_logger = logging.getLogger("verifiers.envs.SingleTurnEnv")  # as the library names an environment's logger
    quiet_model_errors()
    with caplog.at_level(logging.ERROR, logger="verifiers"):
        env_logger.error("Aborted rollout due to EmptyModelResponseError: Model returned empty response")
        env_logger.error("Aborted rollout due to ToolError: the tool failed")
    assert [r.getMessage() for r in caplog.records] == ["Aborted rollout due to ToolError: the tool failed"]


def test_an_environment_that_does_not_load_is_one_line_through_the_cli(tmp_path):
    """`rlfabric train` on a name nothing installs: the config error names the missing module, and the host's load
    failure is no actor crash (whose process would print its creation traceback, a native stack and "Fatal Python
    error: Aborted" beside it)."""
    overrides = ["env.verifiers.id=nosuch_env", "--quiet"]
    errors, stderr = example_stopped_by_config_error("verifiers_env_grpo.yaml", overrides, tmp_path)
    assert len(errors) == 1 and errors[0].startswith("rlfabric: config error: env.verifiers.id = 'nosuch_env'")
    assert errors[0].endswith("(ModuleNotFoundError: No module named 'nosuch_env')"), errors
    for noise in ("Traceback", "creation task", "Fatal Python error", "SIGABRT"):
        assert noise not in stderr, stderr[-3000:]
