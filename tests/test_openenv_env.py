"""GRPO on an OpenEnv environment server (``env.openenv``): a server written with OpenEnv's own API
(``envs/openenv_guess_number.py``), started by the run in an actor with the library installed (a Ray runtime env:
openenv pins mcp < 2), played through the library's own client sessions; its reward and metadata are named
components; a server that cannot start and settings that cannot work stop with one line."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import ray
from grpo_runs import BASE, example_stopped_by_config_error, merged, run_grpo
from processes import own_processes

from rlfabric.config import ConfigError, config_from_dict
from rlfabric.llm_driver import GRPOTrainer
from rlfabric.run.log import read_metrics

SERVER = "{python} -m uvicorn rlfabric.envs.openenv_guess_number:app --host {host} --port {port} --log-level warning"
GAME = {
    "model": {"builtin": {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "max_positions": 128}},
    "data": {"train": "task:guess_number?min_high=4&max_high=10", "num_train": 16, "num_eval": 6},
    "env": {
        "max_turns": 3,
        "openenv": {"command": SERVER, "reward_component": "correct", "components": ["invalid"]},
    },
    "rewards": {"functions": [], "weights": {"invalid": -0.5}},
    "sampling": {"max_new_tokens": 4},
    "training": {"total_steps": 2, "eval_every": 0, "show_samples": 2},
}


def test_grpo_trains_on_an_openenv_server_through_the_librarys_client(local_ray, tmp_path):
    run = run_grpo(
        tmp_path / "run",
        **{
            **GAME,
            "sft": {"steps": 20, "batch_size": 16, "lr": 3e-3, "player": "rlfabric.envs.guess_number:bisection_player"},
        },
    )
    losses = [r["sft_loss"] for r in run.phase("sft")]
    assert losses[-1] < 0.5 * losses[0]  # the player's episodes, played on the server, are learned
    steps = run.phase("grpo")
    assert len(steps) == 2 and sum(r["trained_rows"] for r in steps) > 0
    for r in steps:  # the server's reward as `correct`, its metadata's `invalid`: both named components
        assert {"reward_correct", "reward_invalid"} <= set(r) and r["turns_mean"] > 1
    assert run.summary["failed_samples"] == 0
    assert [e["label"] for e in run.phase("eval")] == ["initial", "after_sft", "final"]


LOOKUP_SERVER = (
    "{python} -m uvicorn rlfabric.envs.openenv_key_lookup:app --host {host} --port {port} --log-level warning"
)


TOOL_MODEL = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "max_positions": 384}


def test_an_openenv_servers_mcp_tools_are_listed_and_called_by_the_model(local_ray, tmp_path):
    """KeyLookup on an OpenEnv MCPEnvironment: its `lookup` tool is listed into the system message, the warm-up's
    calls run on the server (the player copies what they return), and the policy's own calls reach it too."""
    run = run_grpo(
        tmp_path / "run",
        model={
            "builtin": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "max_positions": 384, "alphabet": "tool"}
        },
        data={"train": "task:key_lookup", "num_train": 64, "num_eval": 4},
        env={"max_turns": 3, "openenv": {"command": LOOKUP_SERVER, "tools": True, "reward_component": "correct"}},
        rewards={"functions": []},
        # at temperature 1 the warmed-up policy wrote a well-formed call in 0-40% of a step's episodes (none of 8 in
        # one full-suite run); at 0.6, 27 of 32 in each of two runs
        sampling={"max_new_tokens": 72, "temperature": 0.6},
        # each train row's episode played once on the server and reused (the player and the env are deterministic);
        # at 60 steps the policy's calls mostly named a wrong key and no episode of one full-suite run's step got
        # the server's verdict; at 150, 31 of 32 calls were well formed and 4 episodes solved
        sft={
            "steps": 150,
            "batch_size": 16,
            "lr": 3e-3,
            "demonstrations": 64,
            "player": "rlfabric.envs.key_lookup:lookup_player",
        },
        grpo={"prompts_per_step": 8},
        training={"total_steps": 1, "eval_every": 0, "show_samples": 0},
    )
    losses = [r["sft_loss"] for r in run.phase("sft")]
    assert losses[-1] < 0.2 * losses[0]  # the player's episodes, each a call on the server and the copied value
    (step,) = run.phase("grpo")
    assert step["tool_calls"] > 0 and "reward_correct" in step and run.summary["failed_samples"] == 0, (
        step,
        run.summary,
    )


@pytest.mark.parametrize(
    ("fault", "reason"),
    [(signal.SIGKILL, "the server exited"), (signal.SIGSTOP, "did not answer /health within 2s")],
    ids=["killed", "hung"],
)
def test_a_server_killed_or_hung_mid_run_is_started_again_and_the_run_goes_on(local_ray, tmp_path, fault, reason):
    """SIGKILL: found by the health check or by the next episode's reset; SIGSTOP (alive, never answering): found by
    the health check's missed /health deadline. Either way one restart, counted in the step rows and the summary."""
    changes = {
        "env": {**GAME["env"], "openenv": {**GAME["env"]["openenv"], "health_interval_s": 0.5, "ping_timeout_s": 2}},
        "training": {"total_steps": 6, "eval_every": 0, "show_samples": 0},
    }
    cfg = config_from_dict(merged(merged(BASE, GAME), changes))
    trainer = GRPOTrainer(cfg, tmp_path / "run", quiet=True)
    health = []

    def fault_the_server_after_step_2() -> None:
        while trainer.counters.step < 2:
            time.sleep(0.02)
        host = trainer.episodes.openenv_host
        os.killpg(ray.get(host.health.remote())["pid"], fault)
        while trainer.counters.step < 5:
            time.sleep(0.02)
        health.append(ray.get(host.health.remote()))

    try:
        trainer.setup()
        faulter = threading.Thread(target=fault_the_server_after_step_2, daemon=True)
        faulter.start()
        summary = trainer.train()
        faulter.join(timeout=60)
    finally:
        trainer.close()
    assert len(health) == 1 and health[0]["restarts"] == 1 and health[0]["alive"], health
    assert reason in health[0]["last_error"]
    assert summary["steps"] == 6 and summary["openenv_server_restarts"] == 1
    steps = [r for r in read_metrics(tmp_path / "run") if r.get("phase") == "grpo"]
    assert [r["openenv_server_restarts"] for r in steps][:2] == [0, 0] and steps[-1]["openenv_server_restarts"] == 1
    assert steps[-1]["trained_samples"] > 0  # the last steps trained on the restarted server's episodes


def trainer(tmp_path, **changes):
    return GRPOTrainer(config_from_dict(merged(merged(BASE, GAME), changes)), tmp_path / "run", quiet=True)


def test_a_server_that_does_not_start_is_one_line_naming_the_command(local_ray, tmp_path):
    command = "{python} -c 'import sys; print(\"no such env\"); sys.exit(3)'"
    t = trainer(tmp_path, env={"openenv": {"command": command}})
    with pytest.raises(ConfigError, match=r"env.openenv.command = .*: starting it .* exited with 3: .* no such env"):
        t.setup()
    assert t.generators is None
    assert not [name for name in ray.util.list_named_actors() if name.startswith("rlfabric-openenv-")]


def test_a_server_that_never_answers_is_stopped_with_its_host(local_ray, tmp_path):
    """A server that starts but never serves /health: the run stops with one line, and neither the server (a
    shell's child here) nor its host is left behind."""
    command = "sleep 300 && {python} -m uvicorn x:app --port {port}"
    t = trainer(tmp_path, env={"openenv": {"command": command, "start_timeout_s": 3}})
    with pytest.raises(ConfigError, match=r"did not answer /health within 3s"):
        t.setup()
    assert not [name for name in ray.util.list_named_actors() if name.startswith("rlfabric-openenv-")]
    assert own_processes("sleep 300 && ") == []


def test_a_server_dies_with_its_host_actor(local_ray):
    """A host actor that dies abruptly (ray.kill: no stop() runs) takes its server with it: the server is the host's
    own child (no shell between them), killed by the kernel when its parent dies."""
    from rlfabric.llm_openenv import start_openenv

    host, _, _ = start_openenv(config_from_dict(merged(BASE, GAME)))
    pid = ray.get(host.health.remote())["pid"]
    ray.kill(host)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}")


def test_an_observation_without_the_named_field_is_one_line(local_ray, tmp_path):
    t = trainer(tmp_path, env={"openenv": {"observation_key": "board"}})
    with pytest.raises(ConfigError, match="env.openenv.observation_key = 'board': the observation has metadata, text"):
        t.setup()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"env": {"id": "rlfabric/GuessNumber-v0"}}, "env.openenv.command = .* is not valid: is exclusive with env.id"),
        ({"env": {"openenv": {"start_timeout_s": 0}}}, "env.openenv.start_timeout_s = 0.0 is not valid"),
    ],
)
def test_openenv_settings_that_cannot_work_are_one_line_config_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(merged(merged(BASE, GAME), changes))


def test_a_url_nothing_answers_at_is_one_line_naming_it(local_ray, tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    t = trainer(tmp_path, env={"openenv": {"command": "", "url": url}})
    with pytest.raises(ConfigError) as info:
        t.setup()
    message = str(info.value)
    assert message.startswith(f"env.openenv.url = {url!r}: starting it"), message
    assert f"the OpenEnv server at {url} did not answer /health" in message and "\n" not in message, message
    assert "Traceback" not in message and "ray::" not in message
    assert t.generators is None
    assert not [name for name in ray.util.list_named_actors() if name.startswith("rlfabric-openenv-")]


def test_a_server_that_does_not_start_prints_no_actor_traceback_through_the_cli(tmp_path):
    """Through `rlfabric train` (the host's output reaches the console): the config error line, and no traceback of
    the host actor's constructor beside it."""
    command = "env.openenv.command=\"{python} -c 'import sys; sys.exit(3)'\""  # YAML-quoted: it starts with {
    errors, stderr = example_stopped_by_config_error("openenv_grpo.yaml", [command], tmp_path)
    assert len(errors) == 1 and "exited with 3" in errors[0], stderr[-3000:]
    for noise in ("Traceback", "creation task", "Fatal Python error"):
        assert noise not in stderr, stderr[-3000:]


def test_a_tool_parser_that_does_not_exist_is_one_line_naming_the_field(local_ray, tmp_path):
    t = trainer(tmp_path, env={"tool_parser": "qwen3", "openenv": {"tools": True}})
    with pytest.raises(ConfigError, match="^env.tool_parser = 'qwen3' is not valid: expected one of hermes$"):
        t.setup()
    assert not [name for name in ray.util.list_named_actors() if name.startswith("rlfabric-openenv-")]
