"""One streamable HTTP MCP server process: started from a command line that names its port as ``{port}``, ready
once an MCP session opens on it, stopped with everything it started.

``HttpServerProcess(command, host)`` picks a free port on ``host`` (127.0.0.1 by default; a node's address for
episodes on other nodes), filled in for ``{port}`` and ``{host}`` in the command; ``await start(timeout_s)``
launches the process in a process group of its own (killed with its parent on Linux, so it never outlives
whoever started it) and keeps the probe session it opened, whose ``ping()`` is a health check; ``await stop()``
ends the probe and the whole process group. The supervised ``ToolServer`` actor restarts one of these;
``rlfabric tools check`` runs one.

A command without ``{port}`` is a stdio server (``is_stdio_command``): ``StdioGatewayProcess(command, host)`` runs
it behind the stdio gateway (``rlfabric.mcp_stdio_gateway``: streamable HTTP in front, a child process of the
command per session), with ``state()`` (the gateway's sessions, their children's pids, the last child's failure)
and ``reprobe()`` (a fresh probe session, so a fresh child: the command still starts) for its health checks.
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

from rlfabric.mcp_tools import McpSession, McpStartError, server_command

PORT_FIELD = "{port}"
HOST_FIELD = "{host}"


def http_command(command: str | list[str], port: int, host: str = "127.0.0.1") -> list[str]:
    """The server's argv with ``{port}`` (and ``{host}``, where it has one) filled in; ValueError when the command
    has no ``{port}`` to fill."""
    argv = server_command(command)
    if not any(PORT_FIELD in part for part in argv):
        raise ValueError(
            f"tool server command {shlex.join(argv)!r} has no {PORT_FIELD}: a supervised server serves streamable "
            f"HTTP on the port it is given, e.g. 'python -m rlfabric.envs.notes_server --http {PORT_FIELD}'"
        )
    return [part.replace(PORT_FIELD, str(port)).replace(HOST_FIELD, host) for part in argv]


def is_stdio_command(command: str | list[str]) -> bool:
    """Whether a tool server's command line serves stdio, having no ``{port}`` to serve HTTP on."""
    return not any(PORT_FIELD in part for part in server_command(command))


def gateway_command(command: str | list[str]) -> list[str]:
    """The stdio gateway's command line (with ``{port}`` and ``{host}``) serving the stdio server ``command``."""
    gateway = [sys.executable, "-m", "rlfabric.mcp_stdio_gateway", "--port", PORT_FIELD, "--host", HOST_FIELD]
    return [*gateway, "--", *server_command(command)]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the server binds it right after)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def die_with_parent() -> None:
    """``preexec_fn`` of a server process: a process group of its own (stopped whole by ``end_process_group``),
    killed when its parent dies (Linux), so it never outlives its parent."""
    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


async def end_process_group(process: asyncio.subprocess.Process, grace_s: float, wait_first: bool = False) -> None:
    """Stop a process started with ``die_with_parent`` and everything it started: wait up to ``grace_s`` for it to
    exit by itself (when ``wait_first``: its stdin was just closed), then SIGTERM its group and wait ``grace_s``,
    then SIGKILL it."""
    for sig in ([None] if wait_first else []) + [signal.SIGTERM, signal.SIGKILL]:
        if sig is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
        try:
            await asyncio.wait_for(process.wait(), grace_s)
            return
        except (asyncio.TimeoutError, TimeoutError):
            continue


class HttpServerProcess:
    """See the module docstring. ``name`` labels the server in errors."""

    def __init__(self, name: str, command: str | list[str], host: str = "127.0.0.1") -> None:
        self.name = name
        self.port = free_port(host)
        self.argv = http_command(command, self.port, host)
        self.url = f"http://{host}:{self.port}/mcp"
        self.process: asyncio.subprocess.Process | None = None
        self.probe: McpSession | None = None
        self._log = tempfile.TemporaryFile()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self, timeout_s: float = 30.0) -> str:
        """Launch the server and wait until an MCP session opens on it; its URL. Raises RuntimeError naming the
        server, its command, why, and the tail of its log when it does not come up within ``timeout_s``."""
        await self._launch()
        deadline = time.monotonic() + timeout_s
        reason = "no answer"
        while time.monotonic() < deadline:
            if self.process.returncode is not None:
                reason = f"exited with status {self.process.returncode}"
                break
            try:
                self.probe = await McpSession.open(self.url, max(deadline - time.monotonic(), 0.1))
            except Exception as exc:  # noqa: BLE001 - not listening yet; tried again until the deadline
                reason = str(exc)
                await asyncio.sleep(0.1)
                continue
            return self.url
        await self.stop()
        raise RuntimeError(
            f"tool server {self.name!r} ({shlex.join(self.argv)}) did not start within {timeout_s:g}s: {reason}; "
            f"log: {self.log_tail()}"
        )

    async def _launch(self) -> None:
        self._log.seek(0)
        self._log.truncate()
        self.process = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            preexec_fn=die_with_parent,
        )

    async def ping(self, timeout_s: float) -> None:
        """One ping on the probe session within ``timeout_s`` (TimeoutError, or the session's error)."""
        if self.probe is None:
            raise RuntimeError(f"tool server {self.name!r} is not running")
        await asyncio.wait_for(self.probe.ping(), timeout_s)

    def log_tail(self, lines: int = 5) -> str:
        """The last lines the server wrote (stdout and stderr), joined by ' | '."""
        self._log.seek(0)
        return " | ".join(self._log.read().decode(errors="replace").strip().splitlines()[-lines:]) or "(empty)"

    async def stop(self) -> None:
        """End the probe session and the server's whole process group (SIGTERM, then SIGKILL after 5 s)."""
        probe, self.probe = self.probe, None
        if probe is not None:
            with contextlib.suppress(Exception):
                await probe.close(timeout_s=2.0)
        process = self.process
        if process is None or process.returncode is not None:
            return
        await end_process_group(process, grace_s=5.0)  # its group: nothing it started stays behind


class StdioGatewayProcess(HttpServerProcess):
    """The stdio gateway serving the stdio server ``command`` (see the module docstring); its probe session holds
    a child of the command."""

    def __init__(self, name: str, command: str | list[str], host: str = "127.0.0.1") -> None:
        self.stdio_argv = server_command(command)
        super().__init__(name, gateway_command(self.stdio_argv), host)
        self.health_url = self.url.removesuffix("/mcp") + "/health"
        self._http: Any = None

    async def start(self, timeout_s: float = 30.0) -> str:
        """Launch the gateway, wait until it answers, and open the probe session (the first child of the command);
        its URL. Raises RuntimeError naming the server and the command: the gateway's log when the gateway does not
        come up within ``timeout_s``, else why the command's child did not start (its exit status and stderr)."""
        await self._launch()
        deadline = time.monotonic() + timeout_s
        reason = "no answer"
        while True:
            assert self.process is not None
            if self.process.returncode is not None:
                reason = f"the gateway exited with status {self.process.returncode}"
                break
            if time.monotonic() >= deadline:
                break
            try:
                await self.state(max(min(1.0, deadline - time.monotonic()), 0.1))
            except Exception as exc:  # noqa: BLE001 - not listening yet; tried again until the deadline
                reason = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.1)
                continue
            try:
                await self.reprobe(max(deadline - time.monotonic(), 0.1))
            except RuntimeError as exc:
                await self.stop()
                raise RuntimeError(
                    f"tool server {self.name!r} ({shlex.join(self.stdio_argv)}) did not start: {exc}"
                ) from None
            return self.url
        await self.stop()
        raise RuntimeError(
            f"tool server {self.name!r} ({shlex.join(self.stdio_argv)}) did not start within {timeout_s:g}s: {reason}; "
            f"log: {self.log_tail()}"
        )

    async def state(self, timeout_s: float) -> dict[str, Any]:
        """The gateway's ``/health`` within ``timeout_s``: ``sessions``, ``pids`` (their children), ``last_error``."""
        import httpx2

        if self._http is None:
            self._http = httpx2.AsyncClient(verify=False)  # plain HTTP on this node or the cluster's network
        response = await asyncio.wait_for(self._http.get(self.health_url, timeout=timeout_s), timeout_s)
        response.raise_for_status()
        return dict(response.json())

    async def reprobe(self, timeout_s: float) -> None:
        """Replace the probe session with a fresh one, which starts a fresh child of the command. RuntimeError with
        the gateway's reason (the child's exit status and stderr) when it does not open within ``timeout_s``."""
        old, self.probe = self.probe, None
        if old is not None:
            with contextlib.suppress(Exception):
                await old.close(timeout_s=2.0)
        try:
            self.probe = await McpSession.open(self.url, timeout_s)
        except McpStartError as exc:
            reason = str(exc).split("MCPError: ", 1)[-1]  # the gateway's own words, which name the command: once
            raise RuntimeError(reason.replace(f" ({shlex.join(self.stdio_argv)})", "")) from None

    async def stop(self) -> None:
        await super().stop()
        http, self._http = self._http, None
        if http is not None:
            with contextlib.suppress(Exception):
                await http.aclose()
