"""OpenEnvHost: an OpenEnv environment server, and OpenEnv's own client sessions to it, in an actor of its own.

OpenEnv environments are HTTP / WebSocket servers (``reset``, ``step``, ``state``) written with ``openenv.core``.
The library pins packages rlfabric cannot share a Python environment with (``fastmcp`` < 4, so ``mcp`` < 2), so
its client runs here, in an actor started with a Ray runtime env (``env.openenv.pip``, a virtualenv on top of
rlfabric's), and so does the server when the run starts it: ``env.openenv.command`` (``{port}``, ``{host}`` and
``{python}``, this actor's interpreter, filled in) is launched as a child process and waited for on ``/health``;
``env.openenv.url`` names a server that runs elsewhere. A started server is supervised: every
``health_interval_s`` its process is checked and its ``/health`` must answer within ``ping_timeout_s``; one that
exited or hangs is killed and started again on its port, the restart counted and its reason kept (``health()``),
and so is one found dead when an episode begins. The episodes that held sessions on it fail with it; the new ones
wait for it. Each episode is one
WebSocket session of the library's ``GenericEnvClient`` (one environment instance on the server), opened by
``reset`` and ended by ``close``; ``rlfabric.openenv_env.OpenEnvTextEnv`` is the text env the rollout worker plays
through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import ray

from rlfabric.mcp_server_process import die_with_parent, free_port

HOST_NAME_PREFIX = "rlfabric-openenv-"
SHELL_SYNTAX = re.compile(r"[;&|<>()$`\n]")  # a command line with these runs under /bin/sh


class _DictAction:
    """An action given as a dict, for the MCP client, which sends what an action's ``model_dump`` returns."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def model_dump(self) -> dict[str, Any]:
        return dict(self.fields)


def _result(step: Any) -> dict[str, Any]:
    """A client's ``StepResult`` as plain data: observation (a dict), reward, done, metadata."""
    raw = step.observation
    observation = dict(raw.model_dump() if hasattr(raw, "model_dump") else raw or {})
    for key in ("reward", "done"):
        observation.pop(key, None)
    metadata = {**(observation.get("metadata") or {}), **(step.metadata or {})}
    return {"observation": observation, "reward": step.reward, "done": bool(step.done), "metadata": metadata}


def _exited(process: subprocess.Popen | None) -> str | None:
    """What a server process that is gone exited with (None while it runs)."""
    if process is None or process.poll() is not None:
        return f"the server exited (status {None if process is None else process.returncode})"
    return None


@ray.remote(num_cpus=0, max_restarts=0)
class OpenEnvHost:
    """See the module docstring. ``command`` or ``url`` (exactly one); ``start_timeout_s``: how long the started
    server has to answer ``/health``."""

    def __init__(
        self,
        command: str,
        url: str,
        start_timeout_s: float,
        tools: bool = False,
        health_interval_s: float = 2.0,
        ping_timeout_s: float = 10.0,
    ) -> None:
        self.tools = tools  # sessions through the library's MCP client: the server's tools listed and called
        self.process: subprocess.Popen | None = None
        self.sessions: dict[str, tuple[Any, contextlib.AsyncExitStack]] = {}
        self.line, self.start_timeout_s = "", start_timeout_s
        self.health_interval_s, self.ping_timeout_s = health_interval_s, ping_timeout_s
        self.restarts = 0  # times the server this actor started exited or hung and was started again
        self.last_error: str | None = None  # why it was last restarted
        self.restarting: asyncio.Lock | None = None
        self.monitor: asyncio.Task[None] | None = None
        # Why the server did not start, told by start(): an actor whose constructor raises dies, and its process
        # prints the traceback and a native stack into the run's output beside the driver's one line.
        self.start_error: str | None = None
        if command:
            host = "127.0.0.1"
            port = free_port(host)
            self.line = command.format(port=port, host=host, python=sys.executable)
            # the server's output, kept for its errors, outside the working folder (a run's may be a repository)
            self.log = tempfile.NamedTemporaryFile("w+", prefix=f"openenv-server-{port}-", suffix=".log")  # noqa: SIM115
            url = f"http://{host}:{port}"
            try:
                self._launch(url)
            except Exception as exc:  # noqa: BLE001 - told by start()
                self.start_error = str(exc)
        self.url = url.rstrip("/")

    def _launch(self, url: str) -> None:
        """Start the server and wait until it answers; a server that does not is stopped and the error raised."""
        # a process group of its own (stopping it signals the server under a shell too), killed if this actor dies
        # first (Linux), so a server never outlives its run
        # no shell between this actor and the server unless the line needs one (a shell's child would outlive it)
        shell = bool(SHELL_SYNTAX.search(self.line))
        self.process = subprocess.Popen(
            self.line if shell else shlex.split(self.line),
            shell=shell,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        try:
            self._wait_for(url, self.line, self.start_timeout_s)
        except Exception:
            self._end_server()
            raise

    async def start(self) -> str:
        """The server's URL, its health checks started (a server this actor started); a server that did not start,
        or one at a URL whose ``/health`` does not answer within ``ping_timeout_s``, raises why."""
        if self.start_error is not None:
            raise RuntimeError(self.start_error)
        if not self.line:
            try:
                await asyncio.to_thread(self._get_health, self.ping_timeout_s)
            except OSError as exc:
                raise RuntimeError(f"the OpenEnv server at {self.url} did not answer /health: {exc}") from None
        if self.line and self.monitor is None:
            self.monitor = asyncio.create_task(self._watch())
        return self.url

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            if self._restart_lock().locked():  # a server being started again does not answer yet
                continue
            process = self.process
            problem = await self._check(process)
            if problem is None:
                continue
            try:
                await self._restart(process, problem)
            except Exception as exc:  # noqa: BLE001 - kept for health(); the next check tries again
                self.last_error = f"{problem}; starting it again failed: {exc}"

    async def _check(self, process: subprocess.Popen | None) -> str | None:
        """None when the server serves, else what is wrong with it."""
        exited = _exited(process)
        if exited or process is None:
            return exited
        try:
            await asyncio.to_thread(self._get_health, self.ping_timeout_s)
        except OSError as exc:
            with contextlib.suppress(subprocess.TimeoutExpired):  # a killed server refuses before it is reaped
                await asyncio.to_thread(process.wait, 0.5)
            if process.poll() is not None:
                return _exited(process)
            return f"the server did not answer /health within {self.ping_timeout_s:g}s ({type(exc).__name__})"
        return None

    def _get_health(self, timeout_s: float) -> None:
        with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s):
            pass

    async def _server_alive(self) -> None:
        """Wait for a restart under way, and start the server again when it has died (found when an episode begins,
        before the next health check): new episodes wait for it rather than fail too."""
        if not self.line:
            return
        async with self._restart_lock():
            process = self.process
        exited = _exited(process)
        if exited:
            await self._restart(process, exited)

    def _restart_lock(self) -> asyncio.Lock:
        if self.restarting is None:  # made on the actor's event loop
            self.restarting = asyncio.Lock()
        return self.restarting

    async def _restart(self, found: subprocess.Popen | None, problem: str) -> None:
        """Kill the server process ``found`` wrong and start it again on its port, unless it was replaced meanwhile
        (the episodes that held sessions on it have failed with it)."""
        async with self._restart_lock():
            if self.process is not found:  # restarted already, by the health check or an episode's reset
                return
            self.restarts += 1
            self.last_error = problem
            print(f"[rlfabric] OpenEnv server: {problem}; restarting (restart {self.restarts})", flush=True)
            self._end_server(grace_s=0.0)  # a hung server gets no grace: a stopped process never handles SIGTERM
            self.sessions.clear()  # their sockets died with the server
            await asyncio.to_thread(self._launch, self.url)

    def health(self) -> dict[str, Any]:
        """alive, restarts, last_error, pid (the started server's process group; None for a server at a URL), url."""
        alive = self.process is not None and self.process.poll() is None
        return {
            "alive": alive if self.line else None,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "pid": None if self.process is None else self.process.pid,
            "url": self.url,
        }

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
        self.log.seek(0)
        lines = [ln.strip() for ln in self.log.read().splitlines() if ln.strip()]
        return " | ".join(lines[-2:]) or "(nothing)"

    def _end_server(self, grace_s: float = 10.0) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL after ``grace_s``)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        self.process = None

    def base_url(self) -> str:
        return self.url

    async def reset(self, session: str, task: dict[str, Any]) -> dict[str, Any]:
        """Open ``session`` (a WebSocket of its own) and reset its environment with the task's fields."""
        from openenv.core import GenericEnvClient, MCPToolClient

        await self.close(session)
        await self._server_alive()
        stack = contextlib.AsyncExitStack()
        client_class = MCPToolClient if self.tools else GenericEnvClient
        client = await stack.enter_async_context(client_class(base_url=self.url))
        self.sessions[session] = (client, stack)
        return _result(await client.reset(**task))

    async def step(self, session: str, action: dict[str, Any]) -> dict[str, Any]:
        client, _ = self.sessions[session]
        return _result(await client.step(_DictAction(action) if self.tools else action))

    async def list_tools(self, session: str) -> list[dict[str, Any]]:
        """The tools the session's environment serves: name, description, JSON schema of the arguments."""
        client, _ = self.sessions[session]
        return [
            {"name": t.name, "description": t.description or "", "input_schema": dict(t.input_schema)}
            for t in await client.list_tools()
        ]

    async def call_tool(self, session: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Call a tool on the session's environment: its result as ``text``, or the ``error`` it failed with."""
        client, _ = self.sessions[session]
        try:
            result = await client.call_tool(name, **arguments)
        except Exception as exc:  # noqa: BLE001 - the tool's failure: shown to the agent, not the run's
            return {"text": "", "error": str(exc)}
        return {"text": str(result), "error": None}

    async def close(self, session: str) -> None:
        opened = self.sessions.pop(session, None)
        if opened is not None:
            await opened[1].aclose()

    async def stop(self) -> None:
        """End the health checks, close every session and end the server this actor started."""
        if self.monitor is not None:
            self.monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.monitor
        for session in list(self.sessions):
            await self.close(session)
        self._end_server()
