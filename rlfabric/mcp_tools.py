"""Tools served by an MCP server, through the official ``mcp`` SDK (2.x): one client session per episode.

``McpSession.open(server)`` starts the server given by its command line (stdio transport: a process per session)
or connects to the URL of a running one (streamable HTTP: many sessions per process, each under its own
``mcp-session-id``), initializes an MCP session, and lists the server's tools; ``session.tools()`` turns them
into ``rlfabric.tools.Tool`` objects (their JSON schemas as the chat template's tool definitions), so a
``ToolSet`` checks every call against the schema before anything is sent and runs it under its deadline like any
Python tool. A result flagged ``is_error`` raises ``McpToolError`` (a ``ToolReportedError``): a ``tool_error``
observation for the agent in the server's words;
a call past its deadline is cancelled (the SDK tells the server). Calls from many coroutines on one session are
concurrent.

The SDK's transports open anyio task groups that must be entered and left by the same task, so each session is
owned by one task that opens it, waits for ``close()``, and closes it; other tasks only send calls on it. A server
that fails to start raises ``McpStartError`` naming the command and the tail of its stderr (or the URL).

A session whose server is gone (it died, or was restarted under it) raises ``McpSessionLost`` on its next call: an
``EnvFailure``, so the episode that held it ends as failed rather than reading a made-up error. Tools named with
``CONTROL_PREFIX`` (``env_reset``, ``env_state``, ...) are the env's, called with ``call``, never listed for the
agent. Servers supervised as Ray actors: ``rlfabric.actors.tool_server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shlex
import ssl
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from rlfabric.tools import EnvFailure, Tool, ToolReportedError

CONTROL_PREFIX = "env_"  # tools the env calls (reset to a seed, read the state), never shown to the agent


def _drop_termination_warnings(record: logging.LogRecord) -> bool:
    """The SDK warns when the DELETE that ends a session fails, which it does whenever the server has gone (a
    server that did not start, one being replaced): what failed is already told, and the session is closed."""
    return not record.getMessage().startswith("Session termination failed")


logging.getLogger("mcp.client.streamable_http").addFilter(_drop_termination_warnings)


class McpStartError(RuntimeError):
    """An MCP server that did not start or did not answer the handshake."""


class McpToolError(ToolReportedError):
    """A tool result the server flagged as an error (``is_error``); its text is the message, which the agent sees
    as the server's words."""


class McpSessionLost(EnvFailure):
    """The session's server went away (died, restarted, or closed the connection): the episode cannot go on."""


def is_url(server: str | Sequence[str]) -> bool:
    """Whether ``server`` names a running server by its streamable HTTP URL rather than a command line."""
    return isinstance(server, str) and server.startswith(("http://", "https://"))


def server_command(server: str | Sequence[str]) -> list[str]:
    """The argv of an MCP server: a list as given, or a command line split like a shell does. A leading
    ``python`` means this interpreter, so a server of this environment runs under the same packages."""
    argv = shlex.split(server) if isinstance(server, str) else [str(part) for part in server]
    if not argv:
        raise ValueError("MCP server command is empty: give a command line, e.g. 'python -m my_server'")
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def _http_client() -> Any:
    """An HTTP client for one session, with the SDK's timeouts (30 s, 300 s to read a stream). Its TLS context is
    built once per process: loading the CA bundle costs ~30 ms of CPU, more than the whole MCP handshake, and the
    SDK would load it again for every session (even over plain http)."""
    import httpx2

    return httpx2.AsyncClient(timeout=httpx2.Timeout(30.0, read=300.0), verify=_tls_context())


def _first_error(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (anyio task groups wrap what failed inside them)."""
    while getattr(exc, "exceptions", None):  # BaseExceptionGroup (or its backport before Python 3.11)
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    return exc


def result_text(result: Any) -> str:
    """The text an agent reads from a ``CallToolResult``: its text blocks joined by newlines; other blocks (images,
    audio, resources) as ``[<type> content]``."""
    parts = [block.text if block.type == "text" else f"[{block.type} content]" for block in result.content]
    return "\n".join(parts)


class McpSession:
    """One MCP client session: over stdio to its own server process, or over streamable HTTP to a URL."""

    def __init__(self, server: str | Sequence[str]) -> None:
        self.url = str(server) if is_url(server) else None
        self.argv = [self.url] if self.url else server_command(server)
        self.name = self.url or shlex.join(self.argv)  # how errors name the server
        self.listed: list[Any] = []  # the server's mcp.types.Tool list
        self._session: Any = None
        # A stdio server's log, read back when it fails to start (an HTTP server's log is its own process's).
        self._stderr = None if self.url else tempfile.TemporaryFile(mode="w+")
        self._stop = asyncio.Event()
        self._ready: asyncio.Future[None] | None = None
        self._owner: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, server: str | Sequence[str], timeout_s: float = 30.0) -> McpSession:
        """Start the server, initialize the session and list its tools, within ``timeout_s``."""
        session = cls(server)
        session._ready = asyncio.get_running_loop().create_future()
        session._owner = asyncio.create_task(session._own())
        try:
            await asyncio.wait_for(asyncio.shield(session._ready), timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            message = session._failure(f"did not finish the MCP handshake within {timeout_s:g}s")
        except Exception as exc:  # noqa: BLE001 - any start failure is one McpStartError
            reason = _first_error(exc)
            message = session._failure(f"{type(reason).__name__}: {reason}")
        else:
            return session
        await session.close()
        raise McpStartError(message)

    async def _own(self) -> None:
        from mcp import ClientSession, StdioServerParameters, stdio_client
        from mcp.client.streamable_http import streamable_http_client

        assert self._ready is not None
        client = _http_client() if self.url else None
        if self.url:
            transport = streamable_http_client(self.url, http_client=client)
        else:
            params = StdioServerParameters(command=self.argv[0], args=self.argv[1:])
            transport = stdio_client(params, errlog=self._stderr)
        try:
            async with contextlib.AsyncExitStack() as stack:
                if client is not None:  # the SDK leaves a client it was given open: ours closes with the session
                    await stack.enter_async_context(client)
                read, write = await stack.enter_async_context(transport)
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    self.listed = list((await session.list_tools()).tools)
                    self._session = session
                    self._ready.set_result(None)
                    await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to open(), or ends a session already closing
            if not self._ready.done():
                self._ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
        finally:
            self._session = None

    def _failure(self, reason: str) -> str:
        if self._stderr is None:
            return f"MCP server {self.url!r} could not be reached: {reason}"
        self._stderr.seek(0)
        tail = " | ".join(self._stderr.read().strip().splitlines()[-5:])
        return f"MCP server {shlex.join(self.argv)!r} failed to start: {reason}" + (f"; stderr: {tail}" if tail else "")

    def tools(self) -> list[Tool]:
        """The server's tools for the agent, as ``Tool`` objects whose functions call them on this session (the
        env's control tools, named with ``CONTROL_PREFIX``, left out)."""
        return [
            Tool(t.name, t.description or "", dict(t.input_schema), self._caller(t.name))
            for t in self.listed
            if not t.name.startswith(CONTROL_PREFIX)
        ]

    def _caller(self, name: str) -> Any:
        async def call(**arguments: Any) -> str:
            return await self.call(name, arguments)

        call.__name__ = name
        return call

    async def call(self, name: str, arguments: dict[str, Any] | None = None) -> str:
        """Call tool ``name`` on this session (no schema check: ``tools()`` is the checked path) and return its
        text; a result flagged ``is_error`` raises ``McpToolError``, as does a closed session."""
        result = await self._request(lambda session: session.call_tool(name, arguments or {}))
        if result.is_error:
            raise McpToolError(result_text(result))
        return result_text(result)

    async def ping(self) -> None:
        """One MCP ping round trip (a health check); ``McpSessionLost`` when the server is gone."""
        await self._request(lambda session: session.send_ping())

    async def _request(self, send: Any) -> Any:
        from mcp.shared.exceptions import MCPError
        from mcp.types import CONNECTION_CLOSED

        if self._session is None:
            raise McpSessionLost(f"the MCP session to {self.name!r} is closed (its server stopped or restarted)")
        try:
            return await send(self._session)
        except MCPError as exc:
            if exc.code == CONNECTION_CLOSED:
                raise McpSessionLost(f"the MCP server {self.name!r} closed the connection: {exc.message}") from exc
            raise

    async def close(self, timeout_s: float = 10.0) -> None:
        """End the session and stop the server (the SDK closes its stdin, then terminates, then kills it)."""
        self._stop.set()
        if self._owner is not None and not self._owner.done():
            if self._ready is not None and not self._ready.done():
                self._owner.cancel()  # still in the handshake: nothing to wait for
            try:
                await asyncio.wait_for(asyncio.shield(self._owner), timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                self._owner.cancel()
            except asyncio.CancelledError:
                if not self._owner.cancelled():
                    raise  # the caller was cancelled, not the owner
        if self._stderr is not None:
            self._stderr.close()
