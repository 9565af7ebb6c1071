"""OpenEnvHost: an OpenEnv environment server, and OpenEnv's own client sessions to it, in an actor of its own.

OpenEnv environments are HTTP / WebSocket servers (``reset``, ``step``, ``state``) written with ``openenv.core``.
The library pins packages rlfabric cannot share a Python environment with (``fastmcp`` < 4, so ``mcp`` < 2), so
its client runs here, in an actor started with a Ray runtime env (``env.openenv.pip``, a virtualenv on top of
rlfabric's), and so does the server when the run starts it: ``env.openenv.command`` (``{port}``, ``{host}`` and
``{python}``, this actor's interpreter, filled in) is launched as a child process and waited for on ``/health``;
``env.openenv.url`` names a server that runs elsewhere. Each episode is one WebSocket session of the library's
``GenericEnvClient`` (one environment instance on the server), opened by ``reset`` and ended by ``close``;
``rlfabric.openenv_env.OpenEnvTextEnv`` is the text env the rollout worker plays through it.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

import ray

HOST_NAME_PREFIX = "rlfabric-openenv-"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _result(step: Any) -> dict[str, Any]:
    """A ``StepResult`` of the generic client as plain data: observation (a dict), reward, done, metadata."""
    observation = dict(step.observation or {})
    metadata = {**(observation.get("metadata") or {}), **(step.metadata or {})}
    return {"observation": observation, "reward": step.reward, "done": bool(step.done), "metadata": metadata}


@ray.remote(num_cpus=0, max_restarts=0)
class OpenEnvHost:
    """See the module docstring. ``command`` or ``url`` (exactly one); ``start_timeout_s``: how long the started
    server has to answer ``/health``."""

    def __init__(self, command: str, url: str, start_timeout_s: float) -> None:
        self.process: subprocess.Popen | None = None
        self.sessions: dict[str, tuple[Any, contextlib.AsyncExitStack]] = {}
        if command:
            host = "127.0.0.1"
            port = _free_port(host)
            line = command.format(port=port, host=host, python=sys.executable)
            self.log = open(f"openenv-server-{port}.log", "w")  # noqa: SIM115 - the server's output, kept for errors
            self.process = subprocess.Popen(line, shell=True, stdout=self.log, stderr=subprocess.STDOUT)
            url = f"http://{host}:{port}"
            self._wait_for(url, line, start_timeout_s)
        self.url = url.rstrip("/")

    def _wait_for(self, url: str, line: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the OpenEnv server exited with {self.process.returncode}: {line}; its output ends: {self._tail()}"
                )
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the OpenEnv server did not answer /health within {timeout_s:g}s: {line}")

    def _tail(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
        return " | ".join(lines[-2:]) or "(nothing)"

    def base_url(self) -> str:
        return self.url

    async def reset(self, session: str, task: dict[str, Any]) -> dict[str, Any]:
        """Open ``session`` (a WebSocket of its own) and reset its environment with the task's fields."""
        from openenv.core import GenericEnvClient

        await self.close(session)
        stack = contextlib.AsyncExitStack()
        client = await stack.enter_async_context(GenericEnvClient(base_url=self.url))
        self.sessions[session] = (client, stack)
        return _result(await client.reset(**task))

    async def step(self, session: str, action: dict[str, Any]) -> dict[str, Any]:
        client, _ = self.sessions[session]
        return _result(await client.step(action))

    async def close(self, session: str) -> None:
        opened = self.sessions.pop(session, None)
        if opened is not None:
            await opened[1].aclose()

    async def stop(self) -> None:
        """Close every session and end the server this actor started."""
        for session in list(self.sessions):
            await self.close(session)
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
