"""Config loading: every error is one line naming the field; the CLI reports it before Ray starts."""

import subprocess
import sys
import time

import pytest

from rlfabric.config import Config, ConfigError, apply_overrides, load_config, parse_override
from rlfabric.config import ppo_config_from_dict as config_from_dict
from rlfabric.grpo_config import LLMConfig


def _error(data) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults():
    cfg = config_from_dict(None)
    assert isinstance(cfg, Config)
    assert cfg == Config()  # missing sections and keys take the dataclass defaults
    assert cfg.env.id == "gym:CartPole-v1"
    assert isinstance(cfg.ppo.lr, float) and cfg.ppo.lr > 0
    envs = cfg.runners.num_runners * cfg.runners.envs_per_runner
    assert cfg.fragment_length * envs == cfg.ppo.train_batch_size
    assert config_from_dict({}) == cfg
    assert load_config(None, ["algo=ppo"]) == cfg
    # a partial section keeps the defaults of its other keys
    partial = config_from_dict({"ppo": {"lr": 0.123}})
    assert partial.ppo.lr == 0.123 and partial.ppo.gamma == cfg.ppo.gamma and partial.runners == cfg.runners


# -- unknown keys ---------------------------------------------------------------------------------------


def test_unknown_nested_key_names_dotted_path_and_suggests():
    message = _error({"ppo": {"lrr": 1e-3}})
    assert "'ppo.lrr'" in message
    assert "did you mean 'ppo.lr'?" in message


def test_unknown_top_level_key_suggests_section():
    message = _error({"runner": {"num_runners": 2}})
    assert "'runner'" in message
    assert "did you mean 'runners'?" in message


def test_unknown_key_without_close_match_lists_allowed():
    message = _error({"training": {"zzzzzz": 1}})
    assert "'training.zzzzzz'" in message
    assert "did you mean" not in message
    assert "total_env_steps" in message  # lists what is allowed here


def test_a_trl_name_is_answered_with_rlfabrics_key():
    assert _error({"algo": "grpo", "num_generations": 4}).startswith(
        "unknown config key 'num_generations' (TRL's name; rlfabric's is 'grpo.group_size', see docs/migrating.md); "
        "allowed here: algo, "
    )


def test_an_alias_wins_over_a_close_spelling():
    message = _error({"algo": "grpo", "training": {"save_steps": 10}})
    assert "'training.save_steps' (TRL's name; rlfabric's is 'training.checkpoint_every'" in message
    assert "total_steps'?" not in message


def test_a_cleanrl_name_in_a_ppo_config_is_answered_with_the_ppo_key():
    message = _error({"algo": "ppo", "update_epochs": 4})
    assert "'update_epochs' (CleanRL's name; rlfabric's is 'ppo.num_epochs'" in message
    assert "'learning_rate' (CleanRL's name; rlfabric's is 'ppo.lr'" in _error({"algo": "ppo", "learning_rate": 3e-4})
    assert "'runners.num_runners' x 'runners.envs_per_runner'" in _error({"algo": "ppo", "num_envs": 8})


def test_every_unknown_key_of_a_file_is_named_in_the_one_line():
    message = _error({"algo": "grpo", "beta": 0.04, "grpo": {"lrr": 1e-6}, "training": {"max_steps": 5}})
    assert message.startswith("unknown config keys 'beta' (TRL's name; rlfabric's is 'grpo.kl_coef'")
    assert "'grpo.lrr' (did you mean 'grpo.lr'?)" in message
    assert "'training.max_steps' (TRL's name; rlfabric's is 'training.total_steps'" in message
    assert "\n" not in message


def test_language_model_sections_in_a_ppo_config_point_to_algo_grpo():
    message = _error({"algo": "ppo", "data": {"train": "train.parquet"}, "model": {"path": "Qwen/Qwen2.5-0.5B"}})
    assert message.startswith(
        "unknown config keys 'data', 'model.path'; algo: ppo trains Gymnasium and PettingZoo envs, language models "
        "train with algo: grpo; allowed keys: docs/config.md"
    )
    assert "algo: grpo" not in _error({"algo": "ppo", "ppo": {"lrr": 1}})  # a PPO key misspelt: no such hint


@pytest.mark.parametrize(
    "data",
    [{2048: 1}, {"ppo": {None: 1}}, {True: {}}],  # what YAML makes of the keys `2048:`, `null:` and `on:`
    ids=["int", "null", "bool"],
)
def test_non_string_key_is_a_config_error(data):
    message = _error(data)
    assert "unknown config key" in message


@pytest.mark.parametrize("field, value", [("ppo.lr", float("inf")), ("ppo.target_kl", -0.01)])
def test_out_of_range_float_names_the_field(field, value):
    section, key = field.split(".")
    message = _error({section: {key: value}})
    assert message.startswith(f"{field} = ")


def test_config_must_be_a_mapping():
    assert "mapping" in _error([1, 2])


# -- types ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, field, bad, expected",
    [
        ({"ppo": {"num_epochs": "ten"}}, "ppo.num_epochs", "'ten'", "an integer"),
        ({"ppo": {"num_epochs": 2.5}}, "ppo.num_epochs", "2.5", "an integer"),
        ({"ppo": {"num_epochs": True}}, "ppo.num_epochs", "True", "an integer"),
        ({"ppo": {"lr": "fast"}}, "ppo.lr", "'fast'", "a number"),
        ({"ppo": {"anneal_lr": "yes"}}, "ppo.anneal_lr", "'yes'", "true or false"),
        ({"ppo": {"target_kl": "x"}}, "ppo.target_kl", "'x'", "a number or null"),
        ({"model": {"activation": "gelu"}}, "model.activation", "'gelu'", "one of 'tanh', 'relu'"),
        ({"model": {"hidden_sizes": 64}}, "model.hidden_sizes", "64", "a list"),
        ({"model": {"hidden_sizes": [64, "x"]}}, "model.hidden_sizes[1]", "'x'", "an integer"),
        ({"env": {"id": 5}}, "env.id", "5", "a string"),
        ({"env": {"kwargs": [1]}}, "env.kwargs", "[1]", "a mapping"),
        ({"runners": {"resources": {"gpu_node": "one"}}}, "runners.resources.gpu_node", "'one'", "a number"),
        ({"ppo": 3}, "ppo", "3", "a mapping"),
    ],
)
def test_wrong_type_names_field_value_and_expected_type(data, field, bad, expected):
    message = _error(data)
    assert message.startswith(f"{field} = {bad} is not valid: expected ")
    assert expected in message


def test_numbers_are_coerced():
    cfg = config_from_dict(
        {"ppo": {"lr": "3e-4", "num_epochs": 4.0, "gamma": 1, "target_kl": "0.02"}, "training": {"stop_return": 5}}
    )
    assert cfg.ppo.lr == 3e-4 and isinstance(cfg.ppo.lr, float)
    assert cfg.ppo.num_epochs == 4 and isinstance(cfg.ppo.num_epochs, int)
    assert cfg.ppo.gamma == 1.0 and isinstance(cfg.ppo.gamma, float)
    assert cfg.ppo.target_kl == 0.02
    assert cfg.training.stop_return == 5.0
    assert config_from_dict({"ppo": {"target_kl": None}}).ppo.target_kl is None


def test_yaml_3e_minus_4_string_accepted_as_float(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo: ppo\nppo:\n  lr: 3e-4\n  ent_coef: 1e-2\n")  # YAML 1.1 reads both as strings
    cfg = load_config(path)
    assert cfg.ppo.lr == pytest.approx(3e-4) and isinstance(cfg.ppo.lr, float)
    assert cfg.ppo.ent_coef == pytest.approx(1e-2)
    assert load_config(None, ["algo=ppo", "ppo.lr=5e-4"]).ppo.lr == pytest.approx(5e-4)


# -- ranges ---------------------------------------------------------------------------------------------


def test_train_batch_size_must_be_multiple_of_total_envs():
    message = _error({"runners": {"num_runners": 3, "envs_per_runner": 4}, "ppo": {"train_batch_size": 100}})
    assert message.startswith("ppo.train_batch_size = 100 is not valid:")
    assert "12" in message
    # a multiple is fine, and sets the fragment length
    cfg = config_from_dict(
        {"runners": {"num_runners": 3, "envs_per_runner": 4}, "ppo": {"train_batch_size": 120, "minibatch_size": 60}}
    )
    assert cfg.fragment_length == 10


_EIGHT_ENVS = {"num_runners": 2, "envs_per_runner": 4}


@pytest.mark.parametrize(
    "data, field",
    [
        ({"runners": {"num_runners": 0}}, "runners.num_runners"),
        ({"runners": {"envs_per_runner": -1}}, "runners.envs_per_runner"),
        ({"runners": {"sample_timeout_s": 0}}, "runners.sample_timeout_s"),
        ({"runners": _EIGHT_ENVS, "ppo": {"train_batch_size": 4}}, "ppo.train_batch_size"),  # fewer than the envs
        ({"runners": _EIGHT_ENVS, "ppo": {"train_batch_size": 64, "minibatch_size": 65}}, "ppo.minibatch_size"),
        ({"runners": _EIGHT_ENVS, "ppo": {"train_batch_size": 64, "minibatch_size": 0}}, "ppo.minibatch_size"),
        ({"ppo": {"num_epochs": 0}}, "ppo.num_epochs"),
        ({"ppo": {"lr": 0}}, "ppo.lr"),
        ({"ppo": {"gamma": 1.5}}, "ppo.gamma"),
        ({"ppo": {"gae_lambda": -0.1}}, "ppo.gae_lambda"),
        ({"ppo": {"clip_coef": 0}}, "ppo.clip_coef"),
        ({"ppo": {"max_grad_norm": -1}}, "ppo.max_grad_norm"),
        ({"ppo": {"ent_coef": -0.01}}, "ppo.ent_coef"),
        ({"ppo": {"vf_coef": -0.5}}, "ppo.vf_coef"),
        ({"training": {"total_env_steps": 0}}, "training.total_env_steps"),
        ({"training": {"max_policy_lag": -1}}, "training.max_policy_lag"),
        ({"training": {"eval_episodes": -2}}, "training.eval_episodes"),
        ({"model": {"hidden_sizes": []}}, "model.hidden_sizes"),
        ({"model": {"hidden_sizes": [64, 0]}}, "model.hidden_sizes"),
    ],
)
def test_out_of_range_values(data, field):
    message = _error(data)
    assert message.startswith(f"{field} = ")
    assert "is not valid" in message


def test_boundary_values_are_accepted():
    cfg = config_from_dict(
        {
            "runners": _EIGHT_ENVS,
            "ppo": {"train_batch_size": 8, "gamma": 1, "gae_lambda": 0, "minibatch_size": 8, "vf_coef": 0},
            "training": {"max_policy_lag": 0},
        }
    )
    assert cfg.ppo.gamma == 1.0 and cfg.ppo.gae_lambda == 0.0 and cfg.ppo.minibatch_size == 8
    assert cfg.ppo.vf_coef == 0.0 and cfg.ppo.ent_coef == 0.0
    assert cfg.fragment_length == 1


# -- overrides ------------------------------------------------------------------------------------------


def test_apply_overrides_nested_keys_and_yaml_values():
    data = {"ppo": {"lr": 1e-3}, "env": {"id": "gym:Pendulum-v1"}}
    out = apply_overrides(
        data,
        ["ppo.gamma=0.9", "env.kwargs.g=9.81", "model.hidden_sizes=[32, 16]", "ppo.target_kl=null", "env.id=x"],
    )
    assert out == {
        "ppo": {"lr": 1e-3, "gamma": 0.9, "target_kl": None},
        "env": {"id": "x", "kwargs": {"g": 9.81}},
        "model": {"hidden_sizes": [32, 16]},
    }
    assert data == {"ppo": {"lr": 1e-3}, "env": {"id": "gym:Pendulum-v1"}}  # input untouched


def test_overrides_win_over_the_file_and_later_over_earlier(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo: ppo\nppo:\n  lr: 0.001\n  gamma: 0.98\nrunners:\n  num_runners: 1\n")
    cfg = load_config(path, ["ppo.lr=0.002", "runners.envs_per_runner=2", "ppo.lr=0.005"])
    assert cfg.ppo.lr == 0.005
    assert cfg.ppo.gamma == 0.98  # untouched by the override of a sibling
    assert cfg.runners.num_runners == 1 and cfg.runners.envs_per_runner == 2


def test_override_errors_are_validated_like_the_file():
    with pytest.raises(ConfigError, match=r"^unknown config key 'ppo\.lrr' \(did you mean 'ppo\.lr'\?\)"):
        load_config(None, ["algo=ppo", "ppo.lrr=0.1"])
    with pytest.raises(ConfigError, match=r"^ppo\.lr = 'abc' is not valid: expected a number$"):
        load_config(None, ["algo=ppo", "ppo.lr=abc"])


@pytest.mark.parametrize("text", ["ppo.lr", "ppo.lr 3e-4", ""])
def test_override_without_equals_is_rejected(text):
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_override(text)
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, [text])


@pytest.mark.parametrize("text", ["=3", "ppo..lr=3", ".lr=3", "ppo.=3"])
def test_override_with_empty_key_parts_is_rejected(text):
    with pytest.raises(ConfigError, match="dotted names"):
        parse_override(text)


def test_override_through_a_non_section_is_rejected():
    with pytest.raises(ConfigError, match=r"ppo\.lr is not a section"):
        apply_overrides({"ppo": {"lr": 1e-3}}, ["ppo.lr.x=1"])


def test_parse_override_reads_values_as_yaml():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=x=y") == (["a"], "x=y")
    assert parse_override("a=") == (["a"], "")


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("ppo: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(listy)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == LLMConfig()  # the default algo is grpo


# -- the CLI --------------------------------------------------------------------------------------------

# id -> (config file text or None, overrides, substrings the one error line must contain)
CLI_CASES = {
    "unknown-key": ("algo: ppo\nppo:\n  lrr: 0.001\n", [], ["'ppo.lrr'", "did you mean 'ppo.lr'?"]),
    # no config file: the first positional is an override
    "wrong-type": (None, ["grpo.lr=abc"], ["grpo.lr = 'abc'", "expected a number"]),
    "unknown-gym-env": (
        "algo: ppo\ntraining:\n  seed: 3\n",
        ["env.id=gym:NoSuchEnv-v0"],
        ["env.id = 'gym:NoSuchEnv-v0'"],
    ),
    "unknown-env-name": ("{}\n", ["algo=ppo", "env.id=not_a_registered_name"], ["env.id = 'not_a_registered_name'"]),
    "non-string-key": ("2048: 1\n", [], ["2048"]),
    "ppo-section-without-algo": ("ppo:\n  lr: 0.001\n", [], ["'ppo'", "algo: ppo"]),
    # both verifiers declare correct (@gives): every group would fail at the reward service
    "two-functions-give-one-component": (
        None,
        ["rewards.functions=[{name: arithmetic}, {name: math}]"],
        ["rewards.functions[0] and rewards.functions[1] both give component 'correct'"],
    ),
}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Run every CLI case at once (each is a fresh interpreter importing torch and ray: seconds apiece)."""
    procs = {}
    start = time.perf_counter()
    for case, (yaml_text, overrides, _) in CLI_CASES.items():
        folder = tmp_path_factory.mktemp(case)
        args = list(overrides)
        if yaml_text is not None:
            (folder / "run.yaml").write_text(yaml_text)
            args.insert(0, str(folder / "run.yaml"))
        procs[case] = (
            folder,
            subprocess.Popen(
                [sys.executable, "-m", "rlfabric.cli", "train", *args],
                cwd=folder,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
    results = {}
    for case, (folder, proc) in procs.items():
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results[case] = (folder, proc.returncode, out, err, time.perf_counter() - start)
    return results


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_config_error_is_one_line_exit_2_before_ray(cli_runs, case):
    folder, returncode, out, err, elapsed = cli_runs[case]
    assert returncode == 2, err
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("rlfabric: config error:")
    for name in CLI_CASES[case][2]:
        assert name in lines[0]
    assert out == ""
    # it failed before anything started: no Ray session logged, no run directory written, and quickly
    assert not (folder / "runs").exists()
    assert elapsed < 60


@pytest.mark.parametrize(
    "data, field",
    [
        ({"training": {"seed": -1}}, "training.seed"),
        ({"runners": {"sample_timeout_s": float("inf")}}, "runners.sample_timeout_s"),
        ({"ppo": {"ent_coef": "nan"}}, "ppo.ent_coef"),
        ({"runners": {"num_cpus": -1}}, "runners.num_cpus"),
        ({"runners": {"resources": {"CPU": 2}}}, "runners.resources.CPU"),
        ({"learner": {"device": "cuda"}}, "learner.device"),
        ({"learner": {"num_cpus": 0}, "ray": {"placement_strategy": "PACK"}}, "learner.num_cpus"),
    ],
)
def test_values_that_would_fail_later_are_rejected_up_front(data, field):
    assert _error(data).startswith(f"{field} = ")


def test_resume_refuses_changes_the_checkpoint_depends_on(tmp_path):
    from rlfabric.config import Config, dump_config
    from rlfabric.driver import Trainer

    (tmp_path / "config.yaml").write_text(dump_config(Config()))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "iter_000003.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"^model.hidden_sizes = \[32\] is not valid with --resume"):
        Trainer.from_run_dir(tmp_path, ["model.hidden_sizes=[32]"])
    assert Trainer.from_run_dir(tmp_path, ["training.total_env_steps=500000"]).cfg.training.total_env_steps == 500000
    # at its total without a summary (stopped in its final evaluation): resumed, to finish; a finished run (its
    # summary) only says how to train longer
    assert Trainer.from_run_dir(tmp_path, ["training.total_env_steps=400000"]).resume
    (tmp_path / "summary.json").write_text('{"env": "gym:CartPole-v1", "env_steps": 400000}')
    with pytest.raises(
        ConfigError,
        match=r"^--resume '.*': the run finished at 400000 env steps of 400000; pass training.total_env_steps=N "
        r"with N > 400000 to train longer$",
    ):
        Trainer.from_run_dir(tmp_path, ["training.total_env_steps=400000"])
    assert Trainer.from_run_dir(tmp_path, ["training.total_env_steps=500000"]).resume
    with pytest.raises(ConfigError, match="already holds a run"):
        Trainer(Config(), tmp_path)  # a fresh run must not mix with an old one's checkpoints
    finished = tmp_path / "finished"  # a run too short for a checkpoint
    finished.mkdir()
    (finished / "summary.json").write_text('{"env": "gym:CartPole-v1"}')
    with pytest.raises(ConfigError, match=r"already holds a run \(it has no checkpoint to resume\)"):
        Trainer(Config(), finished)
    (finished / "config.yaml").write_text(dump_config(Config()))
    with pytest.raises(ConfigError) as info:
        Trainer.from_run_dir(finished)
    assert str(info.value) == (
        f"--resume {str(finished)!r}: no checkpoint found under checkpoints/: the run stopped before its first "
        "(training.checkpoint_every: 10)"
    )
    saves_at_end = Config()
    saves_at_end.training.checkpoint_every = 0  # PPO then saves only when it ends
    (finished / "config.yaml").write_text(dump_config(saves_at_end))
    with pytest.raises(ConfigError) as info:
        Trainer.from_run_dir(finished)
    assert str(info.value) == (
        f"--resume {str(finished)!r}: no checkpoint found under checkpoints/: the run stopped before its end, the "
        "only checkpoint training.checkpoint_every: 0 saves"
    )


@pytest.mark.parametrize(
    "data, field",
    [
        ({"sampling": {"stop": [""]}}, "sampling.stop"),
        ({"sampling": {"stop": ["</tool_call>", 3]}}, "sampling.stop[1]"),
        ({"generator": {"session_cache_mb": -1}}, "generator.session_cache_mb"),
        ({"grpo": {"max_logprob_gap": -0.1}}, "grpo.max_logprob_gap"),
    ],
)
def test_multi_turn_settings_out_of_range_name_the_field(data, field):
    message = _error({"algo": "grpo", **data})
    assert message.startswith(f"{field} = ") and "is not valid" in message


def test_adaptive_kl_needs_a_coefficient_and_a_horizon_of_a_step_at_least():
    grpo = {"prompts_per_step": 4, "group_size": 8, "kl_target": 0.05}
    assert _error({"algo": "grpo", "grpo": grpo}).startswith(
        "grpo.kl_target = 0.05 is not valid: must be > 0, with grpo.kl_coef > 0 as the starting coefficient"
    )
    message = _error({"algo": "grpo", "grpo": {**grpo, "kl_coef": 0.1, "kl_horizon": 31}})
    assert message == (
        "grpo.kl_horizon = 31 is not valid: must be at least the samples of a step (grpo.prompts_per_step * "
        "grpo.group_size = 32) with grpo.kl_target, so one update moves the coefficient by at most 20%"
    )
    config = config_from_dict({"algo": "grpo", "grpo": {**grpo, "kl_coef": 0.1, "kl_horizon": 32}})
    assert (config.grpo.kl_target, config.grpo.kl_horizon) == (0.05, 32)


@pytest.mark.parametrize("mini_batches, expected", [(0, "must be at least 1"), (9, "must be at most the rows")])
def test_grpo_mini_batches_between_one_and_the_rows_of_a_learner(mini_batches, expected):
    """4 prompts x 2 completions over 2 learners: 4 rows each, so at most 4 optimizer steps per pass."""
    grpo = {"prompts_per_step": 4, "group_size": 2, "mini_batches": mini_batches}
    message = _error({"algo": "grpo", "grpo": grpo, "learner": {"num_learners": 2}})
    assert message.startswith(f"grpo.mini_batches = {mini_batches} is not valid: {expected}")
    if mini_batches == 9:
        assert message.endswith("(grpo.prompts_per_step * grpo.group_size / learner.num_learners = 4)")
    config = config_from_dict({"algo": "grpo", "grpo": {**grpo, "mini_batches": 4}, "learner": {"num_learners": 2}})
    assert config.grpo.mini_batches == 4
