"""``rlfabric submit``: a training run as a Ray job on a running cluster (``ray start --head``).

What it adds to ``ray job submit ... -- rlfabric train CONFIG``: the config is checked here, before anything is
uploaded; the run directory is made absolute (a job's working folder is a temporary copy, so a relative
``runs/...`` would be lost with it: the path must be one the head node sees, its own disk or shared storage);
the working folder (user modules for ``--import``, the config) ships as the job's ``working_dir``; the cluster's
token is found where Ray keeps it (this Ray turns token authentication on whenever a token exists, and its job
CLI does not send the token unless ``RAY_AUTH_MODE=token``); ``ray job stop`` gets ``--stop-timeout-s`` for the
run to finish its step and write a checkpoint (Ray's default is 3 s, then SIGKILL); and it prints the commands
that follow, logs, stop and ``rlfabric submit --resume RUN_DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from rlfabric.cli_support import IMPORT_HELP, RESUME_COMMAND_ENV, default_run_dir, import_user_modules, run_name
from rlfabric.config import ConfigError, load_config
from rlfabric.ray_connect import use_cluster_token
from rlfabric.run.log import CONFIG_FILE

DEFAULT_DASHBOARD = "http://127.0.0.1:8265"
# Left out of the upload: version control, outputs, environments, caches (Ray also honours .gitignore files).
UPLOAD_EXCLUDES = [".git", "runs", ".venv", "venv", "**/__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache"]
EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 130}
# How long a submission waits for the head's job agent, which comes up after the dashboard; Ray's words for it.
AGENT_WAIT_S = 60.0
NO_AGENT = "No available agent"


def add_submit_parser(sub: Any, func: Any) -> None:
    """The ``submit`` subcommand's arguments."""
    submit = sub.add_parser(
        "submit",
        help="train on a running Ray cluster as a Ray job (the config checked first, the run directory absolute)",
    )
    submit.add_argument("config", nargs="?", help="YAML config file, inside the working folder")
    submit.add_argument("overrides", nargs="*", help="dotted overrides, as for train")
    submit.add_argument("--resume", metavar="DIR", help="continue the run in DIR (on the head node) as a new job")
    submit.add_argument("--run-dir", help="where the job writes (default: <working folder>/runs/<name>-<time>)")
    submit.add_argument(
        "--address",
        help="the cluster's dashboard (default: $RAY_API_SERVER_ADDRESS, an http(s) $RAY_ADDRESS, else "
        f"{DEFAULT_DASHBOARD})",
    )
    submit.add_argument("--working-dir", default=".", help="uploaded as the job's working folder (default: .)")
    submit.add_argument("--import", dest="import_modules", action="append", help=IMPORT_HELP)
    submit.add_argument(
        "--stop-timeout-s", type=int, default=300, help="how long `ray job stop` waits for the checkpoint (300)"
    )
    submit.add_argument("--no-wait", action="store_true", help="return once submitted instead of following the logs")
    submit.set_defaults(func=func)


def dashboard_address(given: str | None) -> str:
    """The Jobs API's address: ``--address``, ``$RAY_API_SERVER_ADDRESS``, an http(s) ``$RAY_ADDRESS``, else the
    local head's default."""
    ray_address = os.environ.get("RAY_ADDRESS", "")
    for candidate in (given, os.environ.get("RAY_API_SERVER_ADDRESS"), ray_address):
        if candidate and (candidate is given or candidate.startswith(("http://", "https://"))):
            return candidate if "://" in candidate else f"http://{candidate}"
    return DEFAULT_DASHBOARD


def job_entrypoint(args: argparse.Namespace, config: str | None, run_dir: Path) -> str:
    """``rlfabric train ...`` as the job runs it: the config relative to the working folder, the run directory
    absolute."""
    words = ["rlfabric", "train"]
    if args.resume:
        words += ["--resume", str(run_dir)]
    else:
        words += ([config] if config else []) + ["--run-dir", str(run_dir)]
    words += list(args.overrides)
    for module in args.import_modules or []:
        words += ["--import", module]
    return shlex.join(words)


def _plan(args: argparse.Namespace, working_dir: Path) -> tuple[str | None, Path, str]:
    """(the config's path in the working folder, the absolute run directory, the job's name); every check that
    can be made here, made."""
    import_user_modules(args.import_modules)
    if args.resume:
        if args.config:
            raise ConfigError("--resume DIR uses the run's saved config; pass only key=value overrides, not a file")
        run_dir = Path(args.resume).resolve()
        if not (run_dir / CONFIG_FILE).is_file():
            raise ConfigError(f"--resume {args.resume}: no {CONFIG_FILE} there (is it a run directory on this node?)")
        cfg = load_config(str(run_dir / CONFIG_FILE), args.overrides)
        return None, run_dir, f"{run_name(cfg)}-resumed"
    cfg = load_config(args.config, args.overrides)  # the same checks as train, before anything is uploaded
    config = None
    if args.config:
        path = Path(args.config).resolve()
        if not path.is_relative_to(working_dir):
            raise ConfigError(
                f"config {args.config}: not inside the working folder {working_dir}, which is what the job gets "
                "(move it there or pass --working-dir)"
            )
        config = str(path.relative_to(working_dir))
    run_dir = Path(args.run_dir) if args.run_dir else working_dir / default_run_dir(cfg)
    return config, run_dir.resolve(), run_name(cfg)


def cmd_submit(args: argparse.Namespace) -> int:
    """Check, submit, print what follows, and (unless ``--no-wait``) follow the job's logs to its end."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    working_dir = Path(args.working_dir).resolve()
    if not working_dir.is_dir():
        raise ConfigError(f"--working-dir {args.working_dir}: no such folder")
    config, run_dir, name = _plan(args, working_dir)
    address = dashboard_address(args.address)
    token = use_cluster_token()
    try:
        client = JobSubmissionClient(address)
    except AuthenticationError:
        raise ConfigError(
            f"--address {address}: the cluster asks for its token and none was found: copy the head's "
            "~/.ray/auth_token here, or set RAY_AUTH_TOKEN (`ray get-auth-token` on the head prints it)"
            if not token
            else f"--address {address}: the cluster refused this token (RAY_AUTH_TOKEN / ~/.ray/auth_token)"
        ) from None
    except ConnectionError as exc:
        raise ConfigError(
            f"--address {address}: no Ray dashboard answers there ({exc.__class__.__name__}); start a cluster with "
            "`ray start --head`, or pass its dashboard's address"
        ) from None
    resume = shlex.join(["rlfabric", "submit", "--resume", str(run_dir), *_address_words(address)])
    excludes = list(UPLOAD_EXCLUDES)
    if run_dir.is_relative_to(working_dir):
        excludes.append(str(run_dir.relative_to(working_dir)))
    job = {
        "entrypoint": job_entrypoint(args, config, run_dir),
        "submission_id": f"rlfabric-{name}-{time.strftime('%Y%m%d-%H%M%S')}",
        "runtime_env": {
            "working_dir": str(working_dir),
            "excludes": excludes,
            "env_vars": {
                "RAY_JOB_STOP_WAIT_TIME_S": str(args.stop_timeout_s),
                "PYTHONUNBUFFERED": "1",
                RESUME_COMMAND_ENV: resume,  # what the run, stopped in the job, says to continue with
            },
        },
        "metadata": {"run_dir": str(run_dir)},
    }
    try:
        job_id = _submit(client, job)
    except RuntimeError as exc:  # the Jobs API's refusals: one line, not a traceback
        said = " ".join(str(exc).split())
        if NO_AGENT in said:  # still, after AGENT_WAIT_S
            said += (
                f" (the head's job agent did not come up within {AGENT_WAIT_S:g}s: its log is dashboard_agent.log in "
                "the head's Ray session logs, /tmp/ray/session_latest/logs by default; restarting the head with "
                "`ray stop` and `ray start --head` starts it again)"
            )
        print(f"rlfabric: {address} did not take the job: {said}", file=sys.stderr)
        return 1
    print(
        f"rlfabric: submitted {job_id} to {address}\n"
        f"  run directory (on the head node): {run_dir}\n"
        f"  logs:   {job_command('logs -f', job_id, address, token)}\n"
        f"  stop:   {job_command('stop', job_id, address, token)}   (the run checkpoints first, up to "
        f"{args.stop_timeout_s}s)\n"
        f"  resume: {resume}",
        file=sys.stderr,
    )
    if args.no_wait:
        return 0
    return _follow(client, job_id, job_command("logs -f", job_id, address, token))


def _address_words(address: str) -> list[str]:
    """``--address ADDRESS`` where a command run later in the same shell would not find it by itself: anything but
    the local default, or the default while ``$RAY_API_SERVER_ADDRESS`` / ``$RAY_ADDRESS`` (which Ray's job CLI
    reads first) are set."""
    if address == DEFAULT_DASHBOARD and not (os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")):
        return []
    return ["--address", address]


def job_command(verb: str, job_id: str, address: str, token: bool) -> str:
    """``ray job VERB JOB_ID`` as it runs when pasted: with ``RAY_AUTH_MODE=token`` when the cluster's token is used
    (Ray's job CLI sends it only then) and the dashboard's address when it is not the one the CLI finds itself."""
    words = ["ray", "job", *verb.split(), job_id, *_address_words(address)]
    return ("RAY_AUTH_MODE=token " if token else "") + shlex.join(words)


def _submit(client: Any, job: dict[str, Any]) -> str:
    """``client.submit_job(**job)``, asked again for up to ``AGENT_WAIT_S`` while the head's job agent is not up yet
    (right after ``ray start``, the dashboard answers before the agent that runs jobs does)."""
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return client.submit_job(**job)
        except RuntimeError as exc:
            if NO_AGENT not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _follow(client: Any, job_id: str, logs_command: str) -> int:
    """Print the job's logs as they come; its exit code from its final status."""

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)

    try:
        asyncio.run(tail())
    except KeyboardInterrupt:
        print(f"\nrlfabric: stopped following; the job goes on ({logs_command})", file=sys.stderr)
        return 0
    status = str(client.get_job_status(job_id).value)
    for _ in range(50):  # the log stream can end a moment before the status settles
        if status in EXIT_CODES:
            break
        time.sleep(0.2)
        status = str(client.get_job_status(job_id).value)
    print(f"rlfabric: job {job_id} {status.lower()}", file=sys.stderr)
    return EXIT_CODES.get(status, 1)
