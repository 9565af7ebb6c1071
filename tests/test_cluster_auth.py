"""A cluster with token authentication (this Ray turns it on whenever a token exists): `rlfabric train` joining one
finds the token as `rlfabric submit` does, a refused or missing token is one line naming it (not "start a cluster
there"), and the commands `submit` prints after submitting run as printed. No cluster here: Ray's client and
``ray.init`` are stood in for, raising what Ray raises (checked by hand against a `ray start --head` cluster).
"""

from __future__ import annotations

import shlex
import shutil
import socket
from pathlib import Path

import pytest
import ray
import ray.job_submission

import rlfabric.submit
from rlfabric.cli import build_parser
from rlfabric.config import ConfigError, RayConfig
from rlfabric.driver import ensure_ray

ROOT = Path(__file__).resolve().parent.parent

# What ray.init raises when the cluster refuses the token (Ray 2.60): a ConnectionError from a RuntimeError that
# carries the AuthenticationError's text.
REFUSED = (
    "Failed to connect to GCS. Last connection error: Traceback (most recent call last):\n"
    "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication token is missing or incorrect. "
    "Note: RAY_AUTH_MODE is currently 'disabled' (not 'token')."
)


@pytest.fixture
def listening():
    """An address where something listens (ensure_ray looks before it calls ray.init)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def fake_init(monkeypatch):
    """ray.init stood in for: raises ``calls['raise']`` if set, and records whether the token was turned on."""
    assert not ray.is_initialized()
    calls: dict = {"token_on": False, "inits": 0}

    def use_cluster_token() -> bool:
        calls["token_on"] = True
        return calls.get("token", True)

    def init(**kwargs):
        calls["inits"] += 1
        calls["token_on_at_init"] = calls["token_on"]
        if "raise" in calls:
            try:
                raise RuntimeError(REFUSED)
            except RuntimeError as cause:
                raise ConnectionError(f"Failed to connect to Ray cluster at {kwargs['address']}") from cause

    monkeypatch.setattr(rlfabric.submit, "use_cluster_token", use_cluster_token)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    return calls


def test_train_joining_a_cluster_turns_the_token_on_before_it_connects(listening, fake_init, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", listening)
    ensure_ray(RayConfig(), wanted_cpus=1)
    assert fake_init["inits"] == 1 and fake_init["token_on_at_init"]


@pytest.mark.parametrize(
    "token, mode, words",
    [
        (True, None, ["refused this token", "RAY_AUTH_TOKEN", "~/.ray/auth_token", "ray get-auth-token"]),
        (False, None, ["token authentication", "no token was found", "~/.ray/auth_token", "RAY_AUTH_TOKEN"]),
        (False, "disabled", ["token authentication", "RAY_AUTH_MODE=disabled", "RAY_AUTH_MODE=token"]),
    ],
)
def test_a_refused_token_is_one_line_naming_it_not_start_a_cluster(
    listening, fake_init, monkeypatch, token, mode, words
):
    monkeypatch.setenv("RAY_ADDRESS", listening)
    if mode is None:
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    else:
        monkeypatch.setenv("RAY_AUTH_MODE", mode)
    fake_init.update({"token": token, "raise": True})
    with pytest.raises(ConfigError) as err:
        ensure_ray(RayConfig(), wanted_cpus=1)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"RAY_ADDRESS={listening!r} (from the environment): ")
    for word in words:
        assert word in message, message
    assert "start a cluster" not in message


class FakeJobClient:
    """The Jobs API stood in for: takes the job, names it by its submission id."""

    def __init__(self, address: str) -> None:
        self.address = address

    def submit_job(self, **job) -> str:
        return job["submission_id"]


def printed_follow_ups(tmp_path, monkeypatch, capsys, token: bool, address: str | None) -> dict[str, list[str]]:
    """The logs/stop/resume lines ``rlfabric submit --no-wait`` prints, each split as a shell would."""
    shutil.copy(ROOT / "examples/cartpole_ppo.yaml", tmp_path / "ppo.yaml")
    monkeypatch.chdir(tmp_path)
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", FakeJobClient)
    monkeypatch.setattr(rlfabric.submit, "use_cluster_token", lambda: token)
    argv = ["submit", "ppo.yaml", "--no-wait"] + (["--address", address] if address else [])
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    lines = {}
    for line in capsys.readouterr().err.splitlines():
        key, _, command = line.strip().partition(":")
        if key in ("logs", "stop", "resume"):
            lines[key] = shlex.split(command.split("   (")[0])
    assert set(lines) == {"logs", "stop", "resume"}
    return lines


def test_submits_printed_commands_carry_the_token_mode_and_the_address(tmp_path, monkeypatch, capsys):
    lines = printed_follow_ups(tmp_path, monkeypatch, capsys, token=True, address="http://head:8265")
    for key in ("logs", "stop"):
        # Ray's job CLI sends the token only with RAY_AUTH_MODE=token, and finds no dashboard but a local one
        assert lines[key][0] == "RAY_AUTH_MODE=token", lines[key]
        assert lines[key][1:4] == ["ray", "job", key]
        assert lines[key][-2:] == ["--address", "http://head:8265"], lines[key]
    assert lines["resume"][:3] == ["rlfabric", "submit", "--resume"]
    assert lines["resume"][-2:] == ["--address", "http://head:8265"]


def test_submits_printed_commands_at_the_local_default_need_no_address(tmp_path, monkeypatch, capsys):
    lines = printed_follow_ups(tmp_path, monkeypatch, capsys, token=False, address=None)
    assert lines["logs"][:4] == ["ray", "job", "logs", "-f"] and len(lines["logs"]) == 5
    assert lines["stop"][:3] == ["ray", "job", "stop"] and len(lines["stop"]) == 4
    assert "--address" not in lines["resume"]
