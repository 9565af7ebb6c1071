"""A cluster with token authentication (this Ray turns it on whenever a token exists): the commands `rlfabric
submit` prints after submitting run as printed (Ray's job CLI sends the token only with RAY_AUTH_MODE=token). Ray's
job client is stood in for (checked by hand against a `ray start --head` cluster with a token).
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import ray
import ray.job_submission

import rlfabric.submit
from rlfabric.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


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


class AgentlessJobClient(FakeJobClient):
    """A head whose dashboard answers but whose job agent never comes up: Ray's Jobs API refuses every job so."""

    def submit_job(self, **job) -> str:
        raise RuntimeError("Request failed with status code 503: No available agent to submit job, please try later.")


def test_a_head_whose_job_agent_never_comes_up_is_one_line_pointing_at_its_log(tmp_path, monkeypatch, capsys):
    shutil.copy(ROOT / "examples/cartpole_ppo.yaml", tmp_path / "ppo.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", AgentlessJobClient)
    monkeypatch.setattr(rlfabric.submit, "use_cluster_token", lambda: False)
    monkeypatch.setattr(rlfabric.submit, "AGENT_WAIT_S", 0.0)  # Ray's agent has 60 s to come up; this one never does
    args = build_parser().parse_args(["submit", "ppo.yaml", "--no-wait", "--address", "http://head:8265"])
    assert args.func(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "rlfabric: http://head:8265 did not take the job: Request failed with status code 503: No available agent"
    )
    assert "the head's job agent did not come up within 0s: its log is dashboard_agent.log" in err[0]
