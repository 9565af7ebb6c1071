"""ToolServer: one MCP tool server, started, health-checked, restarted and stopped by a Ray actor that owns it.

The server is a streamable HTTP MCP server started from its command line, which names its port as ``{port}``
(``python -m rlfabric.envs.bank_server --http {port}``): the actor picks a free port on its node, starts the process
(killed with the actor, never left behind), and waits until an MCP session opens on it. Episodes ask
``address()`` for the URL and then talk to the server directly, one MCP session each, so tool calls cost no hop
through the actor; the server keeps each session's state apart.

Supervision: every ``health_interval_s`` the actor checks that the process is alive and that a ping on its own
probe session answers within ``ping_timeout_s``. A server that exited, or hangs, is killed and started again on
the same port: ``generation`` goes up, the restart is counted and its reason kept (``health()``). Sessions opened
on the old process are gone with it, so each episode that held one fails on its next call (``McpSessionLost``),
recorded with the error, while new episodes open sessions on the new process. ``address()`` waits for a server that
is (re)starting, up to ``start_timeout_s``. ``stop()`` ends the server; the actor's exit ends it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shlex
import signal
import socket
import sys
import tempfile
import time
from typing import Any

import ray

from rlfabric.mcp_tools import McpSession, server_command

PORT_FIELD = "{port}"


def http_command(command: str | list[str], port: int) -> list[str]:
    """The server's argv with ``{port}`` filled in; ValueError when the command has no ``{port}`` to fill."""
    argv = server_command(command)
    if not any(PORT_FIELD in part for part in argv):
        raise ValueError(
            f"tool server command {shlex.join(argv)!r} has no {PORT_FIELD}: a supervised server serves streamable "
            f"HTTP on the port the actor picks, e.g. 'python -m rlfabric.envs.notes_server --http {PORT_FIELD}'"
        )
    return [part.replace(PORT_FIELD, str(port)) for part in argv]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the server binds it right after)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child before exec: the server must not outlive its actor
    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@ray.remote(num_cpus=0, max_restarts=3, max_task_retries=0)
class ToolServer:
    """See the module docstring. ``name`` labels the server in errors and logs."""

    def __init__(
        self,
        name: str,
        command: str | list[str],
        start_timeout_s: float = 30.0,
        health_interval_s: float = 1.0,
        ping_timeout_s: float = 5.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.name, self.host = name, host
        self.port = free_port(host)
        self.argv = http_command(command, self.port)
        self.url = f"http://{host}:{self.port}/mcp"
        self.start_timeout_s, self.health_interval_s, self.ping_timeout_s = (
            start_timeout_s,
            health_interval_s,
            ping_timeout_s,
        )
        self.generation = 0
        self.restarts = 0
        self.last_error: str | None = None
        self.started_at = 0.0
        self._process: asyncio.subprocess.Process | None = None
        self._probe: McpSession | None = None
        self._log = tempfile.TemporaryFile()
        self._ready = asyncio.Event()
        self._stopped = False
        self._monitor: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Start the server and its health checks; the URL once an MCP session opens on it. Raises with the
        command and the tail of its log when it does not come up within ``start_timeout_s``."""
        await self._launch()
        self._monitor = asyncio.create_task(self._watch())
        return self.url

    async def address(self) -> tuple[str, int]:
        """(URL, generation) of the running server, waiting up to ``start_timeout_s`` for one that is starting."""
        if self._stopped:
            raise RuntimeError(f"tool server {self.name!r} was stopped")
        try:
            await asyncio.wait_for(self._ready.wait(), self.start_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise RuntimeError(
                f"tool server {self.name!r} is not up after {self.start_timeout_s:g}s: {self.last_error}"
            ) from None
        return self.url, self.generation

    def health(self) -> dict[str, Any]:
        """alive, generation, restarts, last_error, pid, url, uptime_s."""
        alive = self._ready.is_set() and self._process is not None and self._process.returncode is None
        return {
            "alive": alive,
            "generation": self.generation,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "pid": None if self._process is None else self._process.pid,
            "url": self.url,
            "uptime_s": time.monotonic() - self.started_at if alive else 0.0,
        }

    async def stop(self) -> None:
        """End the health checks and the server."""
        self._stopped = True
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._monitor
        await self._shutdown()

    # -- the server's life ------------------------------------------------------------------------------------

    async def _launch(self) -> None:
        self._log.seek(0)
        self._log.truncate()
        self._process = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + self.start_timeout_s
        reason = "no answer"
        while time.monotonic() < deadline:
            if self._process.returncode is not None:
                reason = f"exited with status {self._process.returncode}"
                break
            try:
                self._probe = await McpSession.open(self.url, max(deadline - time.monotonic(), 0.1))
            except Exception as exc:  # noqa: BLE001 - not listening yet; retried until the deadline
                reason = str(exc)
                await asyncio.sleep(0.1)
                continue
            self.started_at = time.monotonic()
            self._ready.set()
            return
        await self._shutdown()
        raise RuntimeError(
            f"tool server {self.name!r} ({shlex.join(self.argv)}) did not start within {self.start_timeout_s:g}s: "
            f"{reason}; log: {self._log_tail()}"
        )

    def _log_tail(self, lines: int = 5) -> str:
        self._log.seek(0)
        return " | ".join(self._log.read().decode(errors="replace").strip().splitlines()[-lines:]) or "(empty)"

    async def _watch(self) -> None:
        while not self._stopped:
            await asyncio.sleep(self.health_interval_s)
            problem = await self._check()
            if problem is None or self._stopped:
                continue
            self.last_error = problem
            self._ready.clear()
            await self._shutdown()
            self.generation += 1
            self.restarts += 1
            print(f"[rlfabric] tool server {self.name!r}: {problem}; restarting (restart {self.restarts})", flush=True)
            while not self._stopped:
                try:
                    await self._launch()
                    break
                except Exception as exc:  # noqa: BLE001 - kept for address() and health(); tried again
                    self.last_error = str(exc)
                    await asyncio.sleep(min(5.0, self.health_interval_s * 2))

    async def _check(self) -> str | None:
        """None when healthy, else what is wrong."""
        process = self._process
        if process is None or process.returncode is not None:
            return f"the server exited (status {None if process is None else process.returncode})"
        try:
            assert self._probe is not None
            await asyncio.wait_for(self._probe.ping(), self.ping_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            return f"the server missed its {self.ping_timeout_s:g}s ping deadline"
        except Exception as exc:  # noqa: BLE001 - any failed ping means the server is not serving
            return f"the server failed its ping: {type(exc).__name__}: {exc}"
        return None

    async def _shutdown(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            with contextlib.suppress(Exception):
                await probe.close(timeout_s=2.0)
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)  # its whole process group: nothing it started stays behind
        try:
            await asyncio.wait_for(process.wait(), 5.0)
        except (asyncio.TimeoutError, TimeoutError):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
