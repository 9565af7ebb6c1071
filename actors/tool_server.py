"""ToolServer: one MCP tool server, started, health-checked, restarted and stopped by a Ray actor that owns it.

The server is a streamable HTTP MCP server started from its command line, which names its port as ``{port}`` and
may name its address as ``{host}`` (``python -m rlfabric.envs.bank_server --http {port} --host {host}``): the actor
picks a free port on its node (on 127.0.0.1 when the cluster has one node, else on the node's address, so that
episodes on other nodes reach it; ``serving_address``), starts the process (killed with the actor, never left
behind) and waits until an MCP session opens on it (``rlfabric.mcp_server_process``). Episodes ask ``address()``
for the URL and then talk to the server directly, one MCP session each, so tool calls cost no hop through the
actor; the server keeps each session's state apart.

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
import time
from typing import Any

import ray

from rlfabric.mcp_server_process import HttpServerProcess


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
    ) -> None:
        self.name = name
        self.server = HttpServerProcess(
            name, command, host or serving_address()
        )  # the port stays the same across restarts
        self.url = self.server.url
        self.start_timeout_s, self.health_interval_s, self.ping_timeout_s = (
            start_timeout_s,
            health_interval_s,
            ping_timeout_s,
        )
        self.generation = 0
        self.restarts = 0
        self.last_error: str | None = None
        self.started_at = 0.0
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

    def health(self) -> dict[str, Any]:
        """alive, generation, restarts, last_error, pid, url, uptime_s."""
        alive = self._ready.is_set() and self.server.running
        process = self.server.process
        return {
            "alive": alive,
            "generation": self.generation,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "pid": None if process is None else process.pid,
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
        await self.server.stop()

    # -- the server's life ------------------------------------------------------------------------------------

    async def _launch(self) -> None:
        await self.server.start(self.start_timeout_s)
        self.started_at = time.monotonic()
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
        """None when healthy, else what is wrong."""
        process = self.server.process
        if process is None or process.returncode is not None:
            return f"the server exited (status {None if process is None else process.returncode})"
        try:
            await self.server.ping(self.ping_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            return f"the server missed its {self.ping_timeout_s:g}s ping deadline"
        except Exception as exc:  # noqa: BLE001 - any failed ping means the server is not serving
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):  # a dead process: say it exited
                await asyncio.wait_for(process.wait(), 0.5)
            if process.returncode is not None:
                return f"the server exited (status {process.returncode})"
            return f"the server failed its ping: {type(exc).__name__}: {exc}"
        return None
