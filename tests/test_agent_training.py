"""GRPO on a text env from a config: episodes of several turns played by the rollout worker, trained on by the
learner, evaluated on held-out tasks; a bad env or a model without a chat template stops before any actor starts."""

from __future__ import annotations

import pytest
from grpo_runs import run_grpo

from rlfabric.config import ConfigError, config_from_dict
from rlfabric.llm_driver import GRPOTrainer
from rlfabric.registry import register_env
from rlfabric.text_env import TextStep
from rlfabric.tools import TOOL_CALL_PARSERS, parse_hermes

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


class ShowsItsTask:
    """A user's text env whose tasks have no prompt column: its reset writes the prompt from the task."""

    def reset(self, task):
        raise RuntimeError(f"reset on {task}")

    def step(self, action):
        return TextStep("x")


def test_a_text_envs_task_file_needs_no_prompt_column_and_tells_tasks_apart_by_their_content(tmp_path):
    register_env("shows-its-task", ShowsItsTask)
    tasks = tmp_path / "words.jsonl"
    tasks.write_text("".join(f'{{"word": "w{i % 4}"}}\n' for i in range(8)))  # four tasks, each twice
    data = {"train": str(tasks), "eval": "", "num_train": 2, "num_eval": 2}
    t = trainer(tmp_path, env={"id": "shows-its-task"}, data=data)
    # the rows were read as tasks (no 'prompt' column asked for): setup got as far as resetting the env on one
    with pytest.raises(ConfigError, match=r"env.id = 'shows-its-task': .*reset on \{'word': 'w0'\}"):
        t.setup()
    # with all four tasks trained on, the rows left repeat them: none is held out
    t = trainer(tmp_path, env={"id": "shows-its-task"}, data={**data, "num_train": 4})
    with pytest.raises(ConfigError) as info:
        t.setup()
    assert str(info.value).startswith(
        f"data.train = {str(tasks)!r}: has 0 rows whose task is not a training task, fewer than the 2 asked for"
    ), info.value
    assert t.generators is None


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
    assert (
        main(["envs", "check", "rlfabric/GuessNumber-v0", "--task", '{"secret": 3, "high": 5}', "--action", "4"]) == 0
    )
    assert "step('4') -> 'lower'" in capsys.readouterr().out  # the action reached the env (secret 3)
    assert main(["envs", "check", "rlfabric/GuessNumber-v0"]) == 1  # its reset reads the task's secret
    assert capsys.readouterr().out == (
        "FAIL rlfabric/GuessNumber-v0 (text env): KeyError: 'secret' (reset got the task {}: give it one of its task "
        "rows with --task '{...}')\n"
    )
    register_env("broken-board", Broken)
    assert main(["envs", "check", "broken-board", "--task", "{}"]) == 1
    assert capsys.readouterr().out == "FAIL broken-board (text env): RuntimeError: no board\n"
    register_env("gymnasium-shaped", GymnasiumShaped)
    assert main(["envs", "check", "gymnasium-shaped", "--task", "{}"]) == 1
    assert capsys.readouterr().out == (
        "FAIL gymnasium-shaped (text env): TypeError: step returned tuple, expected a TextStep (from "
        "rlfabric.text_env import TextStep; TextStep(observation, rewards, terminated, truncated, info))\n"
    )


class GymnasiumShaped:
    """A text env whose step returns Gymnasium's five values rather than a TextStep."""

    def reset(self, task):
        return "hi"

    def step(self, action):
        return "bye", {"correct": 1.0}, True, False, {}


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


def guess_number_alone():
    """A text env factory that takes no tool_servers keyword."""
    from rlfabric.envs.guess_number import GuessNumber

    return GuessNumber()


def guess_number_needing_servers(tool_servers):
    """A text env factory whose tool_servers has no default: the check before Ray cannot build it."""
    return guess_number_alone()


@pytest.mark.parametrize("factory", [guess_number_alone, guess_number_needing_servers])
def test_tool_servers_for_a_factory_that_cannot_take_them_stop_setup_before_ray(tmp_path, factory):
    register_env("guess-alone", factory)
    t = trainer(tmp_path, env={"id": "guess-alone", "tool_servers": ["notes"]})
    with pytest.raises(ConfigError) as info:
        t.setup()
    message = str(info.value)
    assert message.startswith(
        f"env.id = 'guess-alone': its factory {factory.__name__} takes no tool_servers keyword with a default"
    )
    assert "tool_servers=None" in message and "\n" not in message
    assert t.generators is None and t.tool_servers == {}  # no actor, no tool server started


def test_a_tool_task_the_builtin_alphabet_cannot_spell_stops_setup_before_ray(tmp_path):
    t = trainer(
        tmp_path, data={"train": "task:key_lookup", "num_train": 8, "num_eval": 2}, env={"id": "rlfabric/KeyLookup-v0"}
    )
    with pytest.raises(ConfigError) as info:
        t.setup()
    message = str(info.value)
    assert message.startswith("model.builtin.alphabet = 'default' has no '_', '{', '\"', '}', which the first task"), (
        message
    )
    assert "'tool'" in message and "first task's opening" in message and "\n" not in message
    assert t.generators is None


@pytest.mark.parametrize(
    ("parser", "says"),
    [
        ("qwen3", "env.tool_parser = 'qwen3' is not valid: expected one of hermes"),  # as with env.agent
        ("hermes2", "env.tool_parser = 'hermes2' is not valid: expected one of hermes"),
        # a parser the user registered: a text env parses its own calls, so it would be silently ignored
        ("mine", "env.tool_parser = 'mine' is not valid with env.id: a text env parses its own tool calls"),
    ],
)
def test_a_tool_parser_misspelt_or_one_a_text_env_would_ignore_stops_setup_before_ray(
    tmp_path, monkeypatch, parser, says
):
    monkeypatch.setitem(TOOL_CALL_PARSERS, "mine", parse_hermes)
    t = trainer(tmp_path, env={"id": "rlfabric/GuessNumber-v0", "tool_parser": parser})
    with pytest.raises(ConfigError, match=says):
        t.setup()
    assert t.generators is None


def at_sign_player(task: dict, messages: list[dict[str, str]]) -> str:
    return "5@"  # '@' is not in the builtin default alphabet


def test_a_player_whose_text_the_model_cannot_spell_is_one_config_error(local_ray, tmp_path):
    sft = {"steps": 2, "batch_size": 4, "player": "test_agent_training:at_sign_player"}
    with pytest.raises(ConfigError) as info:
        run_grpo(tmp_path / "run", sft=sft, training={"total_steps": 1, "eval_every": 0}, **GAME)
    message = str(info.value)
    assert message.startswith(
        "sft.player: a demonstration turn cannot be tokenized: the tokenizer has no token for '@'"
    )
    assert "model.builtin.alphabet" in message and "\n" not in message


class Echo:
    """Shows the task's prompt; any reply ends the episode."""

    def reset(self, task):
        return task["prompt"]

    def step(self, action):
        return TextStep("", {"correct": 0.0}, terminated=True)


def test_a_task_the_model_cannot_spell_fails_its_episodes_not_the_rollout_worker(local_ray, tmp_path):
    import json

    register_env("echo-prompt", Echo)
    rows = [{"prompt": "say hi"}] + [{"prompt": f"mail me{i}@example"} for i in range(11)]
    data, held_out = tmp_path / "tasks.jsonl", tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))  # in order: the first task, checked before Ray, spells
    held_out.write_text(json.dumps({"prompt": "say bye"}) + "\n")
    run = run_grpo(
        tmp_path / "run",
        quiet=False,
        model=GAME["model"],
        data={"train": str(data), "eval": str(held_out), "num_train": 12, "num_eval": 1},
        env={"id": "echo-prompt", "max_turns": 1},
        rewards={"functions": []},
        sampling={"max_new_tokens": 4},
        grpo={"prompts_per_step": 4},
        training={"total_steps": 2, "eval_every": 0, "show_samples": 0},
    )
    assert "replaced" not in run.console, run.console  # no rollout worker crashed
    failed = [line for line in run.console.splitlines() if "episode failed: the opening could not be tokenized" in line]
    assert len(failed) == 1 and "no token for '@'" in failed[0] and "model.builtin.alphabet" in failed[0], run.console
    assert run.summary["failed_samples"] > 0 and run.summary["steps"] == 2


def test_the_warm_up_report_tells_the_first_failed_episode_once_and_counts_the_rest():
    from rlfabric.agent_loop import Episode
    from rlfabric.llm_text_env import DemonstrationReport

    lines: list[str] = []
    report = DemonstrationReport(lines.append)
    report.add([Episode(i, [], error=f"reset raised KeyError: 'task {i}'") for i in range(3)])
    report.add([Episode(3, [], error="reset raised KeyError: 'task 3'"), Episode(4, [])])
    assert lines == [
        "sft.player: a demonstration episode failed: reset raised KeyError: 'task 0' (3 of 3 so far; the first of its "
        "kind: later ones are counted, not printed)"
    ]
    assert (report.episodes, report.failed) == (5, 4)
