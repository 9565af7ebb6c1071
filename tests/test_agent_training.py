"""GRPO on a text env from a config: episodes of several turns played by the rollout worker, trained on by the
learner, evaluated on held-out tasks; a bad env or a model without a chat template stops before any actor starts."""

from __future__ import annotations

import pytest
from grpo_runs import run_grpo

from rlfabric.config import ConfigError, config_from_dict
from rlfabric.llm_driver import GRPOTrainer
from rlfabric.registry import register_env
from rlfabric.text_env import TextStep

GAME = {
    "model": {"builtin": {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "max_positions": 256}},
    "data": {"train": "task:guess_number?min_high=4&max_high=10", "num_train": 16, "num_eval": 6},
    "env": {"id": "rlfabric/GuessNumber-v0", "max_turns": 3, "step_timeout_s": 5.0},
    "rewards": {"functions": [], "weights": {"invalid": -0.5}},
    "sampling": {"max_new_tokens": 4},
}


def test_grpo_trains_on_multi_turn_episodes_of_a_text_env(local_ray, tmp_path):
    run = run_grpo(tmp_path / "run", training={"total_steps": 3, "eval_every": 3, "show_samples": 2}, **GAME)
    steps = run.phase("grpo")
    assert len(steps) == 3
    # A random model rarely writes a number: 'invalid' varies within groups, so the learner has rows to train.
    assert sum(r["trained_rows"] for r in steps) > 0
    assert all(r["reward_invalid"] > 0 for r in steps)
    # Several turns per episode: more tokens than one turn's budget per sample.
    assert max(r["response_length_mean"] for r in steps) > 4 and max(r["turns_mean"] for r in steps) > 1
    assert all(r["tool_calls"] == 0 and r["invalid_tool_calls"] == 0 and r["env_errors"] == 0 for r in steps)
    evals = run.phase("eval")
    assert [e["label"] for e in evals][0] == "initial" and all(0 <= e["eval_accuracy"] <= 1 for e in evals)
    assert run.summary["steps"] == 3


class Broken:
    def reset(self, task):
        raise RuntimeError("no board")

    def step(self, action):
        return TextStep("x")


def trainer(tmp_path, **changes):
    sections = {**GAME, **changes}
    from grpo_runs import BASE, merged

    return GRPOTrainer(config_from_dict(merged(BASE, sections)), tmp_path / "run", quiet=True)


def test_an_env_that_cannot_reset_stops_setup_before_ray_with_its_error(tmp_path):
    register_env("broken-board", Broken)
    t = trainer(tmp_path, env={"id": "broken-board"})
    with pytest.raises(ConfigError, match="env.id = 'broken-board': .*RuntimeError: no board"):
        t.setup()
    assert t.generators is None  # no actor was started


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"env": {"id": "rlfabric/GuessNumber-v0"}, "sft": {"steps": 10}}, "sft.steps = 10 is not valid"),
        (
            {"env": {"id": "rlfabric/GuessNumber-v0"}, "rewards": {"process": {"split": "newline"}}},
            "rewards.process.split = 'newline' is not valid: must be 'none' with env.id",
        ),
        ({"env": {"id": "rlfabric/GuessNumber-v0", "max_turns": 0}}, "env.max_turns = 0 is not valid"),
        (
            {"sft": {"steps": 10, "batch_size": 16, "demonstrations": 8, "player": "m:f"}},
            r"sft.demonstrations = 8 is not valid: must be 0, or at least sft.batch_size \(16\)",
        ),
        ({"env": {"id": ""}, "sft": {"demonstrations": 64}}, "sft.demonstrations = 64 is not valid"),
    ],
)
def test_env_settings_that_cannot_work_are_one_line_config_errors(changes, message):
    from grpo_runs import BASE, merged

    with pytest.raises(ConfigError, match=message):
        config_from_dict(merged(merged(BASE, GAME), changes))


def test_a_gymnasium_env_is_not_taken_for_a_text_env(tmp_path):
    t = trainer(tmp_path, env={"id": "rlfabric/PointMass-v0"})
    with pytest.raises(ConfigError, match="is a Gymnasium env, not a text env"):
        t.setup()


def test_envs_check_plays_one_turn_of_a_text_env(capsys):
    from rlfabric.cli import main

    assert main(["envs", "check", "rlfabric/GuessNumber-v0", "--task", '{"secret": 3, "high": 5}']) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK rlfabric/GuessNumber-v0 (text env): reset -> 'Guess my number, 1 to 5.'; step('')")
    register_env("broken-board", Broken)
    assert main(["envs", "check", "broken-board", "--task", "{}"]) == 1
    assert capsys.readouterr().out == "FAIL broken-board (text env): RuntimeError: no board\n"


def test_sft_warm_up_on_a_scripted_players_episodes(local_ray, tmp_path):
    run = run_grpo(
        tmp_path / "run",
        sft={"steps": 30, "batch_size": 16, "lr": 3e-3, "player": "rlfabric.envs.guess_number:bisection_player"},
        training={"total_steps": 1, "eval_every": 0},
        **GAME,
    )
    losses = [r["sft_loss"] for r in run.phase("sft")]
    assert len(losses) == 30 and losses[-1] < 0.5 * losses[0]  # it learns the demonstrations
    assert run.phase("eval")[1]["label"] == "after_sft"


BEGUN: list[str] = []  # the first message of each episode the counting player began, in this process


def counting_player(task: dict, messages: list[dict[str, str]]) -> str:
    """The bisection player, noting each episode it begins (its first turn: no assistant message yet)."""
    from rlfabric.envs.guess_number import bisection_player

    if not any(m["role"] == "assistant" for m in messages):
        BEGUN.append(messages[0]["content"])
    return bisection_player(task, messages)


def test_a_demonstration_pool_is_played_once_and_every_warm_up_batch_drawn_from_it(local_ray, tmp_path):
    BEGUN.clear()
    run = run_grpo(
        tmp_path / "run",
        sft={
            "steps": 30,
            "batch_size": 8,
            "lr": 3e-3,
            "demonstrations": 24,
            "player": "test_agent_training:counting_player",
        },
        training={"total_steps": 1, "eval_every": 0},
        **GAME,
    )
    assert len(BEGUN) == 24  # 24 episodes, not one batch of 8 for each of the 30 steps
    losses = [r["sft_loss"] for r in run.phase("sft")]
    assert len(losses) == 30 and losses[-1] < 0.5 * losses[0]  # the pool's episodes are learned


def test_a_player_that_names_nothing_stops_setup_before_ray(tmp_path):
    t = trainer(tmp_path, sft={"steps": 5, "player": "rlfabric.envs.guess_number:no_such_player"})
    with pytest.raises(ConfigError, match="sft.player = 'rlfabric.envs.guess_number:no_such_player' is not valid"):
        t.setup()
    assert t.generators is None
