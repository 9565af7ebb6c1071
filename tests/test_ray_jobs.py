"""Training as a Ray job on a cluster started with `ray start --head` (token authentication on, as this Ray turns it
on by default): `rlfabric submit` ships the user's folder (an env module registered with --import), the job's logs
show the progress line, `ray job stop` ends the run with a checkpoint, and `rlfabric submit --resume` continues it.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_cluster import CorridorEnv

from rlfabric.run.log import read_metrics

# Clusters of its own: it stops the shared local instance, so it runs after every module that uses it.
pytestmark = pytest.mark.own_ray

# The env exists only in the submitting folder: a module written there from test_cluster's class.
CORRIDOR_MODULE = "\n".join(
    [
        "import gymnasium as gym",
        "import numpy as np",
        "import rlfabric",
        inspect.getsource(CorridorEnv),
        'rlfabric.register_env("corridor", lambda **kw: CorridorEnv(**kw))',
    ]
)

CONFIG = """algo: ppo
env:
  id: corridor
runners:
  num_runners: 1
  envs_per_runner: 2
ppo:
  train_batch_size: 64
  minibatch_size: 64
  num_epochs: 2
training:
  total_env_steps: {steps}
  checkpoint_every: {checkpoint_every}
  eval_episodes: 2
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str, cwd: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlfabric.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def ray_head():
    """A one-node cluster from `ray start --head --block`, with a temp folder of its own (so jobs' drivers find this
    cluster, not another on the machine), token authentication on with a token of its own (RAY_AUTH_TOKEN_PATH:
    clients find it there, as they find ~/.ray/auth_token); its processes are one process group, stopped at the
    end. Yields the dashboard's address, the environment a user's shell would have (the token's path only) and the
    cluster's own address (the one `ray.init` and RAY_ADDRESS take)."""
    temp_dir = tempfile.mkdtemp(prefix="rfjob-")
    token = Path(temp_dir) / "auth_token"
    token.write_text(secrets.token_hex(32))
    dashboard, gcs_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env["RAY_AUTH_TOKEN_PATH"] = str(token)
    head = subprocess.Popen(
        [
            "ray",
            "start",
            "--head",
            "--block",
            f"--port={gcs_port}",
            "--num-cpus=2",
            "--include-dashboard=true",
            f"--dashboard-port={dashboard}",
            f"--temp-dir={temp_dir}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--disable-usage-stats",
        ],  # fmt: skip
        env={**env, "RAY_AUTH_MODE": "token"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            probe = subprocess.run(
                [sys.executable, "-c", f"from ray.job_submission import JobSubmissionClient as C; C({address!r})"],
                env={**env, "RAY_AUTH_MODE": "token"},
                capture_output=True,
            )
            if probe.returncode == 0:
                break
            assert head.poll() is None, "ray start --head exited"
            time.sleep(1)
        else:
            pytest.fail(f"no Ray dashboard at {address} after 120 s")
        yield address, env, f"127.0.0.1:{gcs_port}"
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            try:
                head.wait(5)  # `ray start --block` takes longer than 15 s to obey SIGTERM: SIGKILL follows
            except subprocess.TimeoutExpired:
                continue
        subprocess.run(["pkill", "-9", "-f", temp_dir], check=False)  # anything that left the process group


@pytest.fixture
def project(tmp_path):
    """A user's folder: an env module and a config; nothing of it is installed."""
    (tmp_path / "corridor_env.py").write_text(CORRIDOR_MODULE)
    return tmp_path


def test_a_submitted_job_trains_a_users_env_and_its_logs_show_progress(ray_head, project):
    address, env, _ = ray_head
    (project / "ppo.yaml").write_text(CONFIG.format(steps=640, checkpoint_every=1))
    done = cli("submit", "ppo.yaml", "--import", "corridor_env", "--address", address, cwd=project, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = Path(done.stderr.split("run directory (on the head node): ")[1].split()[0])
    assert run_dir.parent == project / "runs" and run_dir.name.startswith("corridor-")  # absolute, in the folder
    assert f"rlfabric submit --resume {run_dir}" in done.stderr  # what to do next, printed
    assert "rlfabric: training corridor" in done.stdout  # the job's own output, followed to its end
    assert re.search(r"iter +\d+ \| env steps +[\d,]+ ", done.stdout), done.stdout[-2000:]  # the progress line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_steps"] >= 640


def test_a_stopped_job_leaves_a_checkpoint_and_a_resubmitted_one_continues(ray_head, project):
    address, env, _ = ray_head
    # checkpoint_every 0: a checkpoint at the end only, so the one left is the stop's
    (project / "ppo.yaml").write_text(CONFIG.format(steps=200_000, checkpoint_every=0))
    run_dir = project / "run"
    started = cli("submit", "ppo.yaml", "--import", "corridor_env", "--address", address, "--run-dir", "run",
                  "--no-wait", cwd=project, env=env)  # fmt: skip
    assert started.returncode == 0, started.stderr[-3000:]
    job_id = started.stderr.split("submitted ")[1].split()[0]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and len(read_metrics(run_dir)) < 3:
        time.sleep(0.5)
    assert len(read_metrics(run_dir)) >= 3, "the job trained nothing within 180 s"
    # the real CLI, as a user stops a job: the stop command submit printed, pasted as it is into a shell with no
    # RAY_AUTH_MODE (it carries RAY_AUTH_MODE=token, which Ray's job CLI needs to send the token, and the address)
    printed = next(line for line in started.stderr.splitlines() if line.strip().startswith("stop:"))
    stop_command = printed.split("stop:", 1)[1].split("   (")[0].strip()
    assert stop_command.startswith(f"RAY_AUTH_MODE=token ray job stop {job_id} ") and address in stop_command
    stop = subprocess.run(stop_command, shell=True, env=env, capture_output=True, text=True, timeout=300)
    assert stop.returncode == 0, stop.stderr[-2000:]
    checkpoints = sorted((run_dir / "checkpoints").glob("*"))
    assert checkpoints, "ray job stop left no checkpoint"  # written on the way out (SIGTERM is a stop request)
    stopped_at = read_metrics(run_dir)[-1]["env_steps"]
    assert stopped_at < 200_000
    # the stopped run's last line, in the job's log, gives the resume command submit printed (a new job), not train's
    logs_command = next(line for line in started.stderr.splitlines() if line.strip().startswith("logs:"))
    logs = subprocess.run(logs_command.split("logs:", 1)[1].strip(), shell=True, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    resume = next(line for line in started.stderr.splitlines() if line.strip().startswith("resume:"))
    assert f"continue with {resume.split('resume:', 1)[1].strip()})" in logs.stdout, logs.stdout[-2000:]

    resumed = cli("submit", "--resume", str(run_dir), "training.total_env_steps=" + str(stopped_at + 640),
                  "--import", "corridor_env", "--address", address, cwd=project, env=env)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:] + resumed.stdout[-3000:]
    assert "resuming from" in resumed.stdout
    rows = read_metrics(run_dir)
    env_steps = [r["env_steps"] for r in rows if "env_steps" in r]
    assert env_steps == sorted(env_steps)  # continued from the checkpoint, not started over
    assert env_steps[-1] >= stopped_at + 640


def test_train_joins_a_token_cluster_at_ray_address_with_the_token_this_machine_has(ray_head, project):
    """`ray start` turned token authentication on; `ray.init` alone would not send the token (Ray's retries, then
    "Failed to connect"), so rlfabric sends it when the machine has one, as `ray start` does, and says in one line,
    before Ray's retries, when the token is missing or not the cluster's."""
    _, env, gcs_address = ray_head
    (project / "ppo.yaml").write_text(CONFIG.format(steps=640, checkpoint_every=0))
    env = {**env, "RAY_ADDRESS": gcs_address}  # no RAY_AUTH_MODE: the shell of the recipe in docs/cluster.md
    done = cli("train", "ppo.yaml", "--import", "corridor_env", "--run-dir", "run", cwd=project, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((project / "run" / "summary.json").read_text())["env_steps"] >= 640

    (project / "wrong_token").write_text(secrets.token_hex(32))
    no_token = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN_PATH"} | {"HOME": str(project / "home")}
    for shell, says in [
        ({**env, "RAY_AUTH_TOKEN_PATH": str(project / "wrong_token")}, "that cluster refused this machine's token"),
        (no_token, "that cluster uses token authentication and this machine has no token: set RAY_AUTH_TOKEN"),
    ]:
        refused = cli("train", "ppo.yaml", "--import", "corridor_env", "--run-dir", "run2", cwd=project, env=shell)
        assert refused.returncode == 2, refused.stderr[-3000:]
        lines = [line for line in refused.stderr.splitlines() if line.startswith("rlfabric:")]
        assert lines[-1].startswith(f"rlfabric: config error: RAY_ADDRESS='{gcs_address}' (from the environment): ")
        assert says in lines[-1] and "`ray get-auth-token` on the head prints it" in lines[-1]
        assert "InvalidAuthToken" not in refused.stderr  # said before Ray's retries
        assert not (project / "run2").exists()
