"""ToolServer: one MCP tool server, started, health-checked, restarted and stopped by a Ray actor that owns it.

The command line decides how it serves. One that names its port as ``{port}`` (and may name its address as
``{host}``: ``python -m rlfabric.envs.bank_server --http {port} --host {host}``) is a streamable HTTP server; one
without (``python -m rlfabric.envs.notes_server``) is a stdio server, which serves one session per process, so the
actor runs it behind the stdio gateway (``rlfabric.mcp_stdio_gateway``): streamable HTTP in front, and for each
session its own child process of the command, relaying messages both ways. Either way the actor picks a free port
on its node (on 127.0.0.1 when the cluster has one node, else on the node's address, so that episodes on other
nodes reach it; ``serving_address``), starts the process (killed with the actor, never left behind; the gateway's
children die with it) and waits until an MCP session opens on it (``rlfabric.mcp_server_process``). Episodes ask
``address()`` for the URL and then talk to it directly, one MCP session each, so tool calls cost no hop through the
actor; each session's state stays apart (in the HTTP server, or in its own child).

Supervision: every ``health_interval_s`` the actor checks that the process is alive and answers within
``ping_timeout_s`` (an HTTP server: a ping on the actor's probe session; the gateway: its ``/health``). A server
that exited, or hangs, is killed and started again on the same port: ``generation`` goes up, the restart is counted
and its reason kept (``health()``). Sessions opened on the old process are gone with it, so each episode that held
one fails on its next call (``McpSessionLost``), recorded with the error, while new episodes open sessions on the
new process. Behind the gateway the probe session holds a child of its own, pinged at each check and replaced by a
fresh one every ``probe_interval_s`` (or when it fails), so a command that dies, hangs or no longer starts is seen:
``probe_failures`` counts such checks and ``last_error`` says why; while no fresh session opens the server is not
ready. The gateway is not restarted for it: a child that dies ends only its own session (its episode fails with
``McpSessionLost``, naming the command's exit status and stderr). ``address()`` waits for a server that is
(re)starting, up to ``start_timeout_s``. ``stop()`` ends the server and every child; the actor's exit ends them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import time
from typing import Any

import ray

from rlfabric.mcp_server_process import HttpServerProcess, StdioGatewayProcess, is_stdio_command


def serving_address() -> str:
    """Where a server on this node listens: 127.0.0.1 on a one-node cluster (nothing else can reach it), the node's
    own address on a bigger one, so episodes on other nodes reach it (an MCP server has no authentication of its
    own: keep the cluster's network private, as Ray's own ports need)."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return ray.util.get_node_ip_address() if len(alive) > 1 else "127.0.0.1"


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
        host: str | None = None,
        probe_interval_s: float = 30.0,
    ) -> None:
        self.name = name
        self.stdio = is_stdio_command(command)
        kind = StdioGatewayProcess if self.stdio else HttpServerProcess
        self.server = kind(name, command, host or serving_address())  # the port stays the same across restarts
        self.url = self.server.url
        self.start_timeout_s, self.health_interval_s, self.ping_timeout_s = (
            start_timeout_s,
            health_interval_s,
            ping_timeout_s,
        )
        self.probe_interval_s = probe_interval_s
        self.generation = 0
        self.restarts = 0
        self.probe_failures = 0
        self.last_error: str | None = None
        self.started_at = 0.0
        self._next_probe = 0.0
        self._ready = asyncio.Event()
        self._stopped = False
        self._monitor: asyncio.Task[None] | None = None
        self._starting = asyncio.Lock()

    async def start(self) -> str:
        """Start the server and its health checks; the URL once an MCP session opens on it. Raises with the
        command and the tail of its log when it does not come up within ``start_timeout_s``."""
        if self._monitor is None:
            await self._launch()
            self._monitor = asyncio.create_task(self._watch())
        return self.url

    async def address(self) -> tuple[str, int]:
        """(URL, generation) of the running server, waiting up to ``start_timeout_s`` for one that is starting."""
        if self._stopped:
            raise RuntimeError(f"tool server {self.name!r} was stopped")
        async with self._starting:  # an actor Ray restarted after a crash comes back without its server: start it
            if self._monitor is None:
                await self.start()
        try:
            await asyncio.wait_for(self._ready.wait(), self.start_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise RuntimeError(
                f"tool server {self.name!r} is not up after {self.start_timeout_s:g}s: {self.last_error}"
            ) from None
        return self.url, self.generation

    async def health(self) -> dict[str, Any]:
        """alive, generation, restarts, last_error, pid, url, uptime_s, mode ("http" or "stdio"); behind the stdio
        gateway also probe_failures, sessions (open now, the probe's included) and child_pids (their processes; both
        None when the gateway does not answer)."""
        alive = self._ready.is_set() and self.server.running
        process = self.server.process
        health: dict[str, Any] = {
            "alive": alive,
            "generation": self.generation,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "pid": None if process is None else process.pid,
            "url": self.url,
            "uptime_s": time.monotonic() - self.started_at if alive else 0.0,
            "mode": "stdio" if self.stdio else "http",
        }
        if isinstance(self.server, StdioGatewayProcess):
            state: dict[str, Any] = {}
            if self.server.running:
                with contextlib.suppress(Exception):
                    state = await self.server.state(self.ping_timeout_s)
            health.update(
                probe_failures=self.probe_failures, sessions=state.get("sessions"), child_pids=state.get("pids")
            )
        return health

    async def stop(self) -> None:
        """End the health checks and the server."""
        self._stopped = True
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._monitor
        await self.server.stop()

    # -- the server's life ------------------------------------------------------------------------------------

    async def _launch(self) -> None:
        await self.server.start(self.start_timeout_s)
        self.started_at = time.monotonic()
        self._next_probe = self.started_at + self.probe_interval_s
        self._ready.set()

    async def _watch(self) -> None:
        while not self._stopped:
            await asyncio.sleep(self.health_interval_s)
            problem = await self._check()
            if problem is None or self._stopped:
                continue
            self.last_error = problem
            self._ready.clear()
            await self.server.stop()
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
        """None when the server serves, else what is wrong with it (it is restarted)."""
        process = self.server.process
        if process is None or process.returncode is not None:
            return f"the server exited (status {None if process is None else process.returncode})"
        try:
            if isinstance(self.server, StdioGatewayProcess):
                await self.server.state(self.ping_timeout_s)
            else:
                await self.server.ping(self.ping_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            return f"the server missed its {self.ping_timeout_s:g}s ping deadline"
        except Exception as exc:  # noqa: BLE001 - any failed ping means the server is not serving
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):  # a dead process: say it exited
                await asyncio.wait_for(process.wait(), 0.5)
            if process.returncode is not None:
                return f"the server exited (status {process.returncode})"
            return f"the server failed its ping: {type(exc).__name__}: {exc}"
        if isinstance(self.server, StdioGatewayProcess):
            await self._check_probe(self.server)
        return None

    async def _check_probe(self, server: StdioGatewayProcess) -> None:
        """Ping the probe session's child; replace it by a fresh session (a fresh child) when that fails or every
        ``probe_interval_s``. A failure is counted and kept in ``last_error``; while no fresh session opens, the
        server is not ready (``address()`` waits, then says why)."""
        failed = None
        if server.probe is not None and time.monotonic() < self._next_probe:
            try:
                await server.ping(self.ping_timeout_s)
                return
            except (asyncio.TimeoutError, TimeoutError):
                failed = f"the probe session's server missed its {self.ping_timeout_s:g}s ping deadline"
            except Exception as exc:  # noqa: BLE001 - a dead child: McpSessionLost with its exit status and stderr
                failed = f"the probe session's server failed its ping: {exc}"
        try:
            await server.reprobe(self.start_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the command does not start now: kept for address() and health()
            self._ready.clear()
            failed = f"{failed}; " if failed else ""
            failed += f"a new session of {shlex.join(server.stdio_argv)!r} did not start: {exc}"
        else:
            self._next_probe = time.monotonic() + self.probe_interval_s
            self._ready.set()
        if failed is not None:
            self.probe_failures += 1
            self.last_error = failed
            print(f"[rlfabric] tool server {self.name!r}: {failed}", flush=True)
