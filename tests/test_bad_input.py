"""Bad input fails fast, through the public CLI and API: one line naming the field or file and what is allowed,
exit code 2, and, where the check can run before Ray starts, before it does.

Covered: a ``model.path`` that holds no model, a prompt file without its prompt column or without rows, prompts
too long for the model, ``--import`` of a module in the current directory (on the driver and on Ray workers),
options and overrides in any order, and joining the cluster that ``RAY_ADDRESS`` names.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import ray
from pettingzoo.classic import tictactoe_v3
from ray.cluster_utils import Cluster

from rlfabric import registry
from rlfabric.cli import build_parser, main
from rlfabric.config import ConfigError, RayConfig, load_config
from rlfabric.data import check_prompt_lengths, load_prompts
from rlfabric.llm_driver import GRPOTrainer
from rlfabric.models.hf import check_model_source
from rlfabric.ray_connect import ensure_ray

# Clusters of its own: it stops the shared local instance, so it runs after every module that uses it.
pytestmark = pytest.mark.own_ray

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.builtin.num_layers=1", "model.builtin.hidden_size=32", "model.builtin.num_heads=2", "sft.steps=0"]


@pytest.fixture(autouse=True)
def no_ray_before_or_after():
    """Each test starts without a Ray connection (so "Ray did not start" can be checked) and leaves none."""
    if ray.is_initialized():
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, list[str]]:
    """``rlfabric <argv>`` in this process: (exit code, stdout, stderr lines)."""
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def assert_one_config_error(code: int, out: str, err: list[str], *names: str) -> None:
    assert code == 2, err
    assert out == "" and len(err) == 1, err
    assert err[0].startswith("rlfabric: config error: "), err
    for name in names:
        assert name in err[0], err


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# -- 1. model.path --------------------------------------------------------------------------------------------


def _missing_relative(tmp: Path) -> str:
    return "./no_such_model"


def _missing_in_a_local_folder(tmp: Path) -> str:
    (tmp / "runs").mkdir()
    return "runs/no_such_model"  # shaped like a hub id, but runs/ is here: no hub lookup (retried for ~30 s offline)


def _missing_absolute(tmp: Path) -> str:
    return str(tmp / "no_such_model")


def _missing_in_home(tmp: Path) -> str:
    return "~/no_such_model_folder_for_rlfabric_tests"


def _empty_folder(tmp: Path) -> str:
    (tmp / "empty").mkdir()
    return str(tmp / "empty")


def _weights_without_config(tmp: Path) -> str:
    (tmp / "weights").mkdir()
    (tmp / "weights" / "model.safetensors").write_bytes(b"\0" * 16)
    return str(tmp / "weights")


def _a_file(tmp: Path) -> str:
    (tmp / "config.json").write_text("{}")
    return str(tmp / "config.json")


@pytest.mark.parametrize(
    "make_path",
    [
        _missing_relative,
        _missing_in_a_local_folder,
        _missing_absolute,
        _missing_in_home,
        _empty_folder,
        _weights_without_config,
        _a_file,
    ],
)
def test_model_path_without_a_model_is_one_line_before_ray(make_path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = make_path(tmp_path)
    code, out, err = run_cli(["train", f"model.path={path}", "--run-dir", "run"], capsys)
    assert_one_config_error(code, out, err, f"model.path = {path!r}", "Hugging Face model folder", "hub id")
    assert not ray.is_initialized()
    assert not (tmp_path / "run").exists()  # nothing was written either


def test_hub_id_neither_cached_nor_reachable_is_one_line(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants as hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))  # an empty cache
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)  # no network here: say so instead of retrying for a minute
    code, out, err = run_cli(["train", "model.path=no-such-org/no-such-model"], capsys)
    assert_one_config_error(code, out, err, "model.path = 'no-such-org/no-such-model'", "cache", "HF_HUB_OFFLINE")
    assert not ray.is_initialized()
    # online mode, but nothing answers at the hub's address: said at once, not after the hub client's retries
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # free once closed: nothing listens there
    monkeypatch.setattr(hub, "ENDPOINT", f"http://127.0.0.1:{port}")
    code, out, err = run_cli(["train", "model.path=no_such_model_name"], capsys)
    assert_one_config_error(code, out, err, "'no_such_model_name'", f"the hub cannot be asked (http://127.0.0.1:{port}")


def test_hub_id_in_the_local_cache_is_accepted(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)  # accepted from the cache alone, without asking the hub
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--some-org--some-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text('{"model_type": "qwen2"}')
    check_model_source("some-org/some-model", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="'some-org/other-model'"):
        check_model_source("some-org/other-model", cache_dir=tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "some-org").mkdir()  # a folder of that name here does not hide the cached hub model
    check_model_source("some-org/some-model", cache_dir=tmp_path)


# -- 2. prompt files ------------------------------------------------------------------------------------------


def test_prompt_file_without_the_prompt_column_names_it_and_the_columns(tmp_path):
    path = write_jsonl(
        tmp_path / "qa.jsonl", [{"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}]
    )
    with pytest.raises(ConfigError) as err:
        load_prompts(str(path), num_rows=2000)  # the default data.num_train: the missing column is the news
    assert "no 'prompt' column (data.prompt_key)" in str(err.value)
    assert "'question', 'answer'" in str(err.value)
    assert load_prompts(str(path), num_rows=2, prompt_key="question")[1] == {"question": "2+2=", "answer": "4"}


def _write_empty(path: Path) -> None:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    elif path.name == "list.json":
        path.write_text("[]")
    elif path.name == "blank.jsonl":
        path.write_text("\n  \n")
    else:
        path.write_text("")


@pytest.mark.parametrize("name", ["empty.jsonl", "blank.jsonl", "list.json", "empty.parquet"])
def test_prompt_file_without_rows_says_so(name, tmp_path):
    path = tmp_path / name
    _write_empty(path)
    with pytest.raises(ConfigError, match=f"^data.eval = {re.escape(repr(str(path)))}: the file holds no rows$"):
        load_prompts(str(path), field="data.eval")


def test_a_malformed_or_missing_prompt_file_is_one_line_naming_the_row_or_the_path(tmp_path, monkeypatch, capfd):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1="}\n{"prompt": broken\n')
    with pytest.raises(ConfigError, match=r"^data.train = .*bad.jsonl': could not be read: .*JSON parse error.* row 1"):
        load_prompts(str(path), num_rows=2)
    assert capfd.readouterr().err == ""  # the library's own log line of the error is not printed as well
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError, match=rf"file does not exist \({re.escape(str(tmp_path / 'data'))}.*current directory"
    ):
        load_prompts("data/train.jsonl", num_rows=2)


def test_bad_prompt_file_fails_in_setup_before_ray(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "1+1=", "answer": "2"}])
    trainer = GRPOTrainer(load_config(None, [*TINY, f"data.train={path}"]), tmp_path / "run", quiet=True)
    try:
        with pytest.raises(ConfigError, match=r"^data.train = .*: no 'prompt' column .* 'question', 'answer'"):
            trainer.setup()
        assert not ray.is_initialized()
        assert not (tmp_path / "run").exists()  # read before the run writes anything
    finally:
        trainer.close()


# -- 3. --import from the current directory -------------------------------------------------------------------


def test_import_finds_a_module_in_the_current_directory(cwd_env_module, capsys):
    module, name, _ = cwd_env_module
    assert str(Path.cwd()) not in sys.path
    code, out, err = run_cli(["envs", "check", name, "--import", module], capsys)
    assert code == 0, err
    assert out.startswith(f"OK {name}: observation Box(0.0, 1.0, (1,), float32), action Discrete(2)")


def test_import_of_a_missing_module_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code, out, err = run_cli(["train", "--import", "no_such_module_here", "training.total_steps=5"], capsys)
    assert_one_config_error(code, out, err, "--import 'no_such_module_here'", f"current directory ({tmp_path})")
    assert not ray.is_initialized()


def test_import_of_a_module_that_raises_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    module = f"raises_on_import_{os.getpid()}_{time.monotonic_ns()}"
    (tmp_path / f"{module}.py").write_text("raise RuntimeError('no licence server')\n")
    code, out, err = run_cli(["train", "--import", module], capsys)
    assert_one_config_error(
        code, out, err, f"--import {module!r}", f"RuntimeError: no licence server (at {module}.py:1)"
    )
    code, out, err = run_cli(["train", "--import", f"{module}.py"], capsys)
    assert_one_config_error(code, out, err, f"(a module name: --import {module})")
    assert not ray.is_initialized()


# -- 4. options and overrides in any order --------------------------------------------------------------------


def test_options_and_overrides_in_any_order(capsys):
    args = build_parser().parse_args(
        ["train", "grpo.lr=1e-3", "--import", "m", "training.seed=2", "--run-dir", "x", "sft.steps=0", "--quiet"]
    )
    assert (args.config, args.overrides) == ("grpo.lr=1e-3", ["training.seed=2", "sft.steps=0"])
    assert (args.import_modules, args.run_dir, args.quiet) == (["m"], "x", True)
    # Through main: the override after the options reaches the config (and is checked there).
    code, out, err = run_cli(["train", "grpo.lr=1e-3", "--run-dir", "x", "--quiet", "grpo.lrr=2"], capsys)
    assert_one_config_error(code, out, err, "unknown config key 'grpo.lrr'")
    code, out, err = run_cli(["train", str(ROOT / "examples/cartpole_ppo.yaml"), "--quiet", "ppo.lr=-1"], capsys)
    assert_one_config_error(code, out, err, "ppo.lr = -1")


# -- 5. a PPO env that cannot be built ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, says",
    [
        (
            ["env.kwargs={bogus: 1}"],
            "env.id = 'gym:CartPole-v1': building it and resetting it with env.kwargs = {'bogus': 1} failed: TypeError",
        ),
        (["env.id=rlfabric/GuessNumber-v0"], "returned GuessNumber, expected a gymnasium.Env (a text env or an agent"),
        (["env.id=pettingzoo:classic.tictactoe_v3", "env.kwargs={bogus: 1}"], "resetting it with env.kwargs = {'bogus"),
    ],
)
def test_a_ppo_env_that_cannot_be_built_is_one_line_before_ray(overrides, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["train", str(ROOT / "examples/cartpole_ppo.yaml"), *overrides, "--run-dir", "r"], capsys)
    assert_one_config_error(code, out, err, says)
    assert not ray.is_initialized() and not (tmp_path / "r").exists()


def test_multi_agent_settings_on_a_single_agent_env_are_one_line_before_ray(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # MAPPO's critic on CartPole was ignored: the run trained as if it were unset
    overrides = ["multi_agent.critic=centralized", "--run-dir", "r"]
    code, out, err = run_cli(["train", str(ROOT / "examples/cartpole_ppo.yaml"), *overrides], capsys)
    says = "multi_agent.critic is set, but env.id = 'gym:CartPole-v1' is a single-agent env"
    assert_one_config_error(code, out, err, says)
    assert not ray.is_initialized() and not (tmp_path / "r").exists()


class HangingReset(gym.Wrapper):
    def reset(self, **kwargs):
        threading.Event().wait()  # never returns


def raising_game_reset():
    """Tic-tac-toe whose reset raises: the runners would find it only once Ray runs."""
    env = tictactoe_v3.env()

    def reset(*args, **kwargs):
        raise RuntimeError("no board today")

    env.reset = reset
    return env


def hanging_game_reset():
    env = tictactoe_v3.env()
    env.reset = lambda *args, **kwargs: threading.Event().wait()
    return env


registry.register_env("hanging-cartpole", lambda: HangingReset(gym.make("CartPole-v1")))
registry.register_env("raising-game-reset", raising_game_reset)
registry.register_env("hanging-game-reset", hanging_game_reset)


@pytest.mark.parametrize(
    "env_id, says",
    [
        (
            "hanging-cartpole",
            "env.id = 'hanging-cartpole': reset() did not return within 2s (runners.sample_timeout_s)",
        ),
        ("hanging-game-reset", "env.id = 'hanging-game-reset': reset() did not return within 2s"),
        (
            "raising-game-reset",
            "env.id = 'raising-game-reset': building it and resetting it failed: RuntimeError: no b",
        ),
    ],
)
def test_an_env_whose_reset_hangs_or_raises_is_one_line_before_ray(env_id, says, tmp_path, monkeypatch, capsys):
    """A single-agent env or a game: the driver resets one copy under the runners' deadline (a reset that hung ran
    forever; a game's that raised was found on a runner, once Ray ran)."""
    monkeypatch.chdir(tmp_path)
    example = "cartpole_ppo.yaml" if env_id == "hanging-cartpole" else "tictactoe_selfplay.yaml"
    argv = ["train", str(ROOT / "examples" / example), f"env.id={env_id}", "runners.sample_timeout_s=2"]
    code, out, err = run_cli([*argv, "--run-dir", "r"], capsys)
    assert_one_config_error(code, out, err, says)
    assert not ray.is_initialized() and not (tmp_path / "r").exists()


class DictObservations(gym.Env):
    """A well-behaved env (Gymnasium's checker passes it) whose Dict observations PPO's MLP policy cannot read."""

    observation_space = gym.spaces.Dict({"position": gym.spaces.Box(0.0, 1.0, (2,))})
    action_space = gym.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return {"position": np.zeros(2, np.float32)}, {}

    def step(self, action):
        return {"position": np.zeros(2, np.float32)}, 0.0, True, False, {}


registry.register_env("dict-observations", DictObservations)


def test_spaces_ppo_cannot_use_are_one_line_before_ray_and_fail_envs_check(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["train", str(ROOT / "examples/cartpole_ppo.yaml"), "env.id=dict-observations", "--run-dir", "r"]
    code, out, err = run_cli(argv, capsys)
    assert_one_config_error(code, out, err, "env.id = 'dict-observations': observation space Dict(", "use a Box")
    assert not ray.is_initialized() and not (tmp_path / "r").exists()
    code, out, _ = run_cli(["envs", "check", "dict-observations"], capsys)
    assert code == 1 and out.splitlines()[-1].startswith("FAIL dict-observations: PPO cannot train it: observation")


def test_on_a_cluster_the_driver_leaves_building_the_env_to_the_runners(monkeypatch):
    from rlfabric.game_driver import check_env_builds

    cfg = load_config(ROOT / "examples/cartpole_ppo.yaml", ["env.kwargs={bogus: 1}"])
    with pytest.raises(ConfigError, match="bogus"):
        check_env_builds(cfg)  # a local run: built here
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # its workers may have what this machine lacks
    check_env_builds(cfg)
    check_env_builds(load_config(ROOT / "examples/cartpole_ppo.yaml", ["env.kwargs={bogus: 1}", "ray.address=auto"]))


# -- 6. prompts longer than the model's context ---------------------------------------------------------------


def test_check_prompt_lengths_names_the_longest_prompt_the_limit_and_the_fields():
    prompts = {"data.train": [[1] * 10, [1] * 57, [1] * 60, [1] * 56], "data.eval": [[1] * 5]}
    check_prompt_lengths(prompts, max_new_tokens=4, max_positions=64, model="builtin")  # 60 + 4 fits exactly
    with pytest.raises(ConfigError) as err:
        check_prompt_lengths(prompts, max_new_tokens=8, max_positions=64, model="builtin")
    message = str(err.value)
    assert message.startswith("data.train: 2 of 4 prompts are too long for the model: the longest (row 2) is 60 ")
    assert "sampling.max_new_tokens = 8" in message and "68 positions" in message
    assert "the model's 64 (model.builtin.max_positions)" in message
    with pytest.raises(ConfigError, match=r"^data.eval: .*max_position_embeddings of model.path = 'org/m'"):
        check_prompt_lengths({"data.eval": [[1] * 30]}, max_new_tokens=8, max_positions=32, model="org/m")
    check_prompt_lengths({"data.train": [[1] * 10_000]}, max_new_tokens=8, max_positions=None, model="org/m")


def test_prompts_too_long_for_the_model_fail_in_setup_before_ray(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1="}, {"prompt": "1+" * 30 + "1="}])
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "2+2="}])
    overrides = [*TINY, f"data.train={train}", f"data.eval={held_out}", "data.num_train=null", "data.num_eval=1"]
    cfg = load_config(None, [*overrides, "model.builtin.max_positions=64", "sampling.max_new_tokens=8"])
    trainer = GRPOTrainer(cfg, tmp_path / "run", quiet=True)
    try:
        with pytest.raises(ConfigError, match=r"^data.train: 1 of 2 prompts .* \(row 1\) is 62 tokens.* 70 positions"):
            trainer.setup()
        assert not ray.is_initialized()
        assert not (tmp_path / "run").exists()  # the new run's folder (its model built to tokenize) is removed
    finally:
        trainer.close()


# -- 7. RAY_ADDRESS ---------------------------------------------------------------------------------------------


def test_ray_address_where_nothing_listens_is_one_line(tmp_path, monkeypatch, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    code, out, err = run_cli(["train", str(ROOT / "examples/cartpole_ppo.yaml"), "--quiet"], capsys)
    assert err[0].startswith("rlfabric: training gym:CartPole-v1 -> ")  # the run's own first line, then the error
    assert_one_config_error(
        code, out, err[1:], f"RAY_ADDRESS='127.0.0.1:{port}'", "no Ray cluster answers", "ray start"
    )
    assert time.monotonic() - started < 30  # Ray itself would wait minutes
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def cluster():
    """A running Ray cluster of 3 CPUs that this process is not connected to (as after `ray start --head`)."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False})
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def test_ray_address_from_the_environment_joins_that_cluster(cluster, monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    ensure_ray(RayConfig(num_cpus=8), wanted_cpus=8)  # a local instance would have 8 CPUs
    assert ray.get_runtime_context().gcs_address == cluster.address
    assert ray.cluster_resources()["CPU"] == 3
    assert "ray.num_cpus = 8 sizes only a local instance and is ignored" in capsys.readouterr().err


def test_token_mode_against_a_cluster_without_authentication_is_one_line(cluster, monkeypatch):
    """Its actors would never start (the cluster's workers cannot answer a driver that wants tokens): said before
    ray.init, with what to change."""
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    monkeypatch.setenv("RAY_AUTH_MODE", "Token")  # Ray reads the mode in any case
    with pytest.raises(ConfigError) as info:
        ensure_ray(RayConfig(), wanted_cpus=1)
    assert str(info.value) == (
        f"RAY_ADDRESS={cluster.address!r} (from the environment): RAY_AUTH_MODE=Token, but that cluster does not use "
        "token authentication (its workers could not answer this driver): unset RAY_AUTH_MODE"
    )
    assert not ray.is_initialized()


def test_env_of_an_imported_cwd_module_runs_on_the_joined_cluster(cluster, cwd_env_module, monkeypatch, capsys):
    """A plain `rlfabric train` joins the cluster RAY_ADDRESS names, and its workers run the env registered by an
    --import'ed module of the current directory (options and overrides intermixed)."""
    module, name, marks = cwd_env_module
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    argv = [
        "train",
        str(ROOT / "examples/cartpole_ppo.yaml"),
        f"env.id={name}",
        "--import",
        module,
        "training.total_env_steps=512",
        "--run-dir",
        "run",
        "training.eval_episodes=1",
        "ppo.num_epochs=1",
        "--quiet",
    ]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert ray.cluster_resources()["CPU"] == 3  # the cluster's, not a new local instance
    summary = json.loads(Path("run/summary.json").read_text())
    assert summary["env_steps"] >= 512 and summary["env"] == name
    worker_pids = {int(p.name) for p in marks.iterdir()} - {os.getpid()}
    assert len(worker_pids) >= 2  # the two runners built it in their own processes


def test_a_run_the_joined_cluster_cannot_hold_is_one_line_at_once(cluster, monkeypatch, capsys, tmp_path):
    """The example's runners and a 2-CPU learner (2 runners x 1 CPU + 2) on the 3-CPU cluster: refused when Ray is
    joined, not after a two-minute wait for a learner that cannot start."""
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    argv = ["train", str(ROOT / "examples/cartpole_ppo.yaml"), "learner.num_cpus=2", "--run-dir", str(tmp_path)]
    started = time.monotonic()
    code, out, err = run_cli([*argv, "--quiet"], capsys)
    assert err[0].startswith("rlfabric: training gym:CartPole-v1 -> ")  # the run's own first line, then the error
    assert_one_config_error(
        code,
        out,
        err[1:],
        "the run's actors ask for CPU=4 in all (runners: 2 x CPU=1; learner: 1 x CPU=2) but the cluster has CPU=3",
    )
    assert time.monotonic() - started < 60


def test_a_config_error_after_ray_started_leaves_no_new_run_directory(tmp_path, capsys):
    """A tool server that cannot start is found once Ray runs (its supervisor is an actor): the run stops with one
    line, exit 2, and the new run's folder (config snapshot, initial model, empty metrics) is removed, as for bad
    input found before Ray."""
    run_dir = tmp_path / "runs" / "mcp"
    exiting = f"{sys.executable} -c 'import sys; sys.exit(4)'"
    argv = [
        "train",
        str(ROOT / "examples/agent_mcp_grpo.yaml"),
        "sft.steps=0",
        f"env.tool_servers={{notes: {exiting!r}, files: {exiting!r}}}",
    ]
    code, _, err = run_cli([*argv, "--run-dir", str(run_dir)], capsys)
    assert code == 2, err
    assert err[-1].startswith("rlfabric: config error: env.tool_servers: ") and "did not start" in err[-1], err
    assert not (tmp_path / "runs").exists()
