"""A streamable HTTP front for a stdio MCP server: one child process per MCP session, relayed both ways.

A stdio MCP server serves exactly one session per process. ``StdioGateway(command)`` is an ASGI app that serves
streamable HTTP at ``/mcp`` (the ``mcp`` SDK's ``StreamableHTTPServerTransport``, one JSON body per request) and,
for each session a client initializes, starts its own child from the command line and relays the JSON-RPC messages
unchanged: the client's to the child's stdin, the child's stdout lines back to the client (the design of
mcp-proxy's and supergateway's stateful modes). Sessions share nothing, so what one episode writes no other sees.
The child ends with its session (the client's DELETE, ``idle_timeout_s`` without a request, or the gateway
stopping: stdin closed, then SIGTERM and SIGKILL to its process group) and with the gateway itself (parent-death
signal on Linux), so no process is left behind.

A child that dies ends only its own session: every request it left unanswered, and every later one, gets a JSON-RPC
error with code ``CONNECTION_CLOSED`` (the client's ``McpSessionLost``) whose message names the command, its exit
status and the tail of its stderr; a child that dies before answering ``initialize`` fails the session's start the
same way. A request for a session the gateway does not hold (it ended, expired, or the gateway was restarted) gets
the same error. ``GET /health`` answers ``{"sessions", "pids", "last_error"}``: the sessions open whose child
serves, the pids of the children running (a closed session's child until it has stopped), and why the last child
that ended under its session did.

The children are started here rather than through the SDK's ``stdio_client``, which shows neither the process id
nor its exit status and cannot set the parent-death signal; the wire format is the same (one JSON-RPC message a
line, parsed by the SDK's ``jsonrpc_message_adapter``). Notifications a child sends during a request (progress,
logs) go to the session's GET stream, not to the request's response.

Run by the ``ToolServer`` actor (``rlfabric.actors.tool_server``) for a command without ``{port}``, or by hand::

    python -m rlfabric.mcp_stdio_gateway --port 8765 [--host 127.0.0.1] -- python -m rlfabric.envs.notes_server
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from uuid import uuid4

MAX_LINE = 64 * 1024 * 1024  # the longest JSON-RPC line a child may write (a big tool result)
STOP_GRACE_S = 2.0  # after stdin closes, and again after SIGTERM, before the next signal
DEFAULT_IDLE_TIMEOUT_S = 1800.0  # a session nobody sends a request for this long is ended (the SDK's default)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def exit_reason(returncode: int | None) -> str:
    """How a process ended, in words: ``exited with status 3``, ``was killed by signal 9 (SIGKILL)``."""
    if returncode is None:
        return "closed its stdout"
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = f" ({signal.Signals(-returncode).name})"
    except ValueError:
        name = ""
    return f"was killed by signal {-returncode}{name}"


class StdioChild:
    """One stdio MCP server process: JSON-RPC messages a line on its stdin and stdout, its stderr kept in a file
    whose tail goes into errors. It runs in a process group of its own and dies with the gateway."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)
        self.process: asyncio.subprocess.Process | None = None
        self._stderr = tempfile.TemporaryFile()

    async def start(self) -> None:
        """Spawn it; OSError when the command cannot run at all (no such file, not executable)."""
        from rlfabric.mcp_server_process import die_with_parent

        self.process = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=self._stderr,
            preexec_fn=die_with_parent,
            limit=MAX_LINE,
        )

    async def send(self, message: Any) -> None:
        """Write one message as a line (an error when the child is gone; its end is reported by ``receive``)."""
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(message.model_dump_json(by_alias=True, exclude_unset=True).encode() + b"\n")
        await self.process.stdin.drain()

    async def receive(self) -> Any | None:
        """The next message the child writes; None once its stdout ends. A line that is not JSON-RPC is skipped
        (and noted in its stderr log)."""
        from mcp.types import jsonrpc_message_adapter

        assert self.process is not None and self.process.stdout is not None
        while True:
            try:
                line = await self.process.stdout.readline()
            except (ValueError, ConnectionError):  # a line past MAX_LINE, or the pipe broke
                return None
            if not line:
                return None
            if not line.strip():
                continue
            try:
                return jsonrpc_message_adapter.validate_json(line, by_name=False)
            except ValueError as exc:
                os.write(self._stderr.fileno(), f"[gateway] skipped a stdout line, not JSON-RPC: {exc}\n".encode())

    async def ended(self, timeout_s: float = 1.0) -> str:
        """Why the child's stdout ended: its exit status (waited for up to ``timeout_s``) and its stderr's tail."""
        assert self.process is not None
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            await asyncio.wait_for(self.process.wait(), timeout_s)
        tail = self.stderr_tail()
        return exit_reason(self.process.returncode) + (f"; stderr: {tail}" if tail else "")

    def stderr_tail(self, lines: int = 5) -> str:
        """The last lines the child wrote to stderr, joined by ' | ' (read without moving the file's offset, which
        the child shares)."""
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        text = os.pread(fd, min(size, 65536), max(size - 65536, 0)).decode(errors="replace")
        kept = [" ".join(line.split()) for line in text.splitlines() if line.strip()]  # runs of blanks: one space
        return " | ".join(kept[-lines:])

    async def stop(self) -> None:
        """Close its stdin (an MCP server exits on that), then SIGTERM and SIGKILL its process group, each after
        ``STOP_GRACE_S``."""
        from rlfabric.mcp_server_process import end_process_group

        process = self.process
        if process is not None:
            if process.stdin is not None:
                process.stdin.close()
            await end_process_group(process, STOP_GRACE_S, wait_first=True)
        self._stderr.close()


class _Session:
    """One MCP session: its HTTP transport, its child, the requests the child has not answered yet, and why the
    child is gone (None while it serves)."""

    def __init__(self, transport: Any, child: StdioChild) -> None:
        self.transport = transport
        self.child = child
        self.pending: set[Any] = set()
        self.lost: str | None = None


class StdioGateway:
    """See the module docstring. ASGI app: ``/mcp`` (streamable HTTP) and ``/health`` (GET, JSON)."""

    def __init__(self, command: Sequence[str], idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S) -> None:
        if not command:
            raise ValueError("stdio gateway: the server command is empty")
        self.argv = list(command)
        self.name = shlex.join(self.argv)
        self.idle_timeout_s = idle_timeout_s
        self.sessions: dict[str, _Session] = {}
        self.children: set[StdioChild] = set()  # started and not yet stopped
        self.last_error: str | None = None
        self._tasks: Any = None  # the anyio task group that runs the sessions, open while the app runs

    # -- ASGI ---------------------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            path = scope["path"].rstrip("/")
            if path == "/mcp":
                await self._mcp(scope, receive, send)
            elif path == "/health" and scope["method"] == "GET":
                body = {
                    "sessions": sum(s.lost is None for s in self.sessions.values()),
                    "pids": sorted(c.process.pid for c in self.children if c.process and c.process.returncode is None),
                    "last_error": self.last_error,
                }
                await _respond(send, 200, body)
            else:
                await _respond(send, 404, {"error": f"no {path!r} here: MCP is served at /mcp, health at /health"})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """The sessions' task group lives as long as the app; at shutdown it is cancelled, which stops every child
        (shielded, bounded by ``STOP_GRACE_S``)."""
        import anyio

        message = await receive()
        assert message["type"] == "lifespan.startup"
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            tasks.cancel_scope.cancel()
        self._tasks = None
        await send({"type": "lifespan.shutdown.complete"})

    async def _mcp(self, scope: Scope, receive: Receive, send: Send) -> None:
        from mcp.types import CONNECTION_CLOSED, INVALID_REQUEST
        from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        version = headers.get("mcp-protocol-version")
        if version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS:
            supported = ", ".join(HANDSHAKE_PROTOCOL_VERSIONS)
            await _respond(send, 400, _error(None, INVALID_REQUEST, f"MCP-Protocol-Version {version}: use {supported}"))
            return
        session_id = headers.get("mcp-session-id")
        if session_id is not None:
            session = self.sessions.get(session_id)
            if session is None:  # it ended, expired, or was held by a gateway since restarted: lost to its client
                gone = f"the stdio gateway ({self.name}) has no session {session_id[:64]} (ended, or gateway restarted)"
                await _respond(send, 404, _error(None, CONNECTION_CLOSED, gone))
                return
            await session.transport.handle_request(scope, receive, send)
            if session.transport.is_terminated:
                self.sessions.pop(session_id, None)
            return
        await self._open(scope, receive, send)

    async def _open(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A request without a session id: an ``initialize`` POST opens a session and starts its child."""
        from mcp.server.streamable_http import StreamableHTTPServerTransport
        from mcp.types import CONNECTION_CLOSED, INVALID_REQUEST

        body = await _read_body(receive) if scope["method"] == "POST" else b""
        try:
            method = json.loads(body).get("method")
        except (ValueError, AttributeError):
            method = None
        if method != "initialize":
            await _respond(
                send, 400, _error(None, INVALID_REQUEST, "no mcp-session-id: open a session with initialize")
            )
            return
        session_id = uuid4().hex
        transport = StreamableHTTPServerTransport(
            session_id, is_json_response_enabled=True, idle_timeout=self.idle_timeout_s
        )
        session = _Session(transport, StdioChild(self.argv))
        self.sessions[session_id] = session
        try:
            await self._tasks.start(self._run, session)
        except OSError as exc:  # the command cannot run at all
            self.sessions.pop(session_id, None)
            self.last_error = f"the stdio server ({self.name}) could not be started: {exc}"
            await _respond(send, 502, _error(_request_id(body), CONNECTION_CLOSED, self.last_error))
            return
        await transport.handle_request(scope, _replay(body, receive), send)
        if session.lost is not None or transport.is_terminated:  # its child died in the handshake: nothing to keep
            self.sessions.pop(session_id, None)
            with contextlib.suppress(Exception):
                await transport.terminate()

    # -- one session --------------------------------------------------------------------------------------------

    async def _run(self, session: _Session, *, task_status: Any) -> None:
        """Own the session: its child, its transport's streams, the relay both ways; stop the child at the end. A
        command that cannot run raises OSError to ``_open``; nothing else leaves here (one session's trouble must
        not end the others)."""
        import anyio

        transport, child = session.transport, session.child
        try:
            await child.start()
        except OSError:
            await child.stop()  # closes its stderr file
            raise
        self.children.add(child)
        try:
            async with transport.connect() as (from_client, to_client):
                task_status.started()
                with transport.idle_scope or anyio.CancelScope():
                    async with anyio.create_task_group() as relay:
                        relay.start_soon(self._from_child, session, to_client)
                        await self._to_child(session, from_client, to_client)  # until the client's side closes
                        relay.cancel_scope.cancel()
        except Exception as exc:  # noqa: BLE001 - logged; the session ends, the gateway goes on
            print(f"[rlfabric] stdio gateway ({self.name}): a session failed: {exc!r}", file=sys.stderr, flush=True)
        finally:
            with anyio.CancelScope(shield=True):
                await child.stop()
                self.children.discard(child)
                if self.sessions.get(transport.mcp_session_id) is session:
                    del self.sessions[transport.mcp_session_id]
                if not transport.is_terminated:
                    with contextlib.suppress(Exception):
                        await transport.terminate()

    async def _to_child(self, session: _Session, from_client: Any, to_client: Any) -> None:
        """The client's messages to the child, until the session's streams close (the client's DELETE, or the
        gateway stopping); once the child is gone, each request is answered with why."""
        import anyio
        from mcp.shared.message import SessionMessage
        from mcp.types import CONNECTION_CLOSED, JSONRPCNotification, JSONRPCRequest

        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
            async for item in from_client:
                if isinstance(item, Exception):  # a POST the transport could not read; it answered it already
                    continue
                message = item.message
                if session.lost is not None:
                    if isinstance(message, JSONRPCRequest):
                        await to_client.send(SessionMessage(_error(message.id, CONNECTION_CLOSED, session.lost)))
                    continue
                if isinstance(message, JSONRPCRequest):
                    session.pending.add(message.id)
                elif isinstance(message, JSONRPCNotification) and message.method == "notifications/cancelled":
                    await self._cancelled(session, (message.params or {}).get("requestId"), to_client)
                with contextlib.suppress(ConnectionError, OSError):  # a dead child: reported by _from_child
                    await session.child.send(message)

    async def _cancelled(self, session: _Session, request_id: Any, to_client: Any) -> None:
        """The client gave up on a request (its deadline passed): end the request's HTTP exchange here, since the
        child answers a cancelled request with nothing."""
        from mcp.server.streamable_http import REQUEST_CANCELLED
        from mcp.shared.message import SessionMessage

        if request_id in session.pending:
            session.pending.discard(request_id)
            await to_client.send(SessionMessage(_error(request_id, REQUEST_CANCELLED, "Request cancelled")))

    async def _from_child(self, session: _Session, to_client: Any) -> None:
        """The child's messages to the client; when its stdout ends, the session is lost and each request it left
        unanswered gets the reason."""
        import anyio
        from mcp.shared.message import SessionMessage
        from mcp.types import CONNECTION_CLOSED, JSONRPCError, JSONRPCResponse

        child = session.child
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):  # the session closed
            while (message := await child.receive()) is not None:
                if isinstance(message, JSONRPCResponse | JSONRPCError):
                    if message.id not in session.pending:
                        continue  # answered already (cancelled), or never asked
                    session.pending.discard(message.id)
                await to_client.send(SessionMessage(message))
            session.lost = f"the stdio server of this session ({self.name}) {await child.ended()}"
            self.last_error = session.lost
            print(f"[rlfabric] stdio gateway: {session.lost}", file=sys.stderr, flush=True)
            unanswered, session.pending = sorted(session.pending, key=str), set()
            for request_id in unanswered:
                await to_client.send(SessionMessage(_error(request_id, CONNECTION_CLOSED, session.lost)))


# -- small ASGI helpers ---------------------------------------------------------------------------------------------


def _error(request_id: Any, code: int, message: str) -> Any:
    from mcp.types import ErrorData, JSONRPCError

    return JSONRPCError(jsonrpc="2.0", id=request_id, error=ErrorData(code=code, message=message))


def _request_id(body: bytes) -> Any:
    with contextlib.suppress(ValueError, AttributeError):
        return json.loads(body).get("id")
    return None


async def _respond(send: Send, status: int, body: Any) -> None:
    """One JSON response (a JSON-RPC error, which the SDK's client reads at any status, or a plain object)."""
    if hasattr(body, "model_dump_json"):
        data = body.model_dump_json(by_alias=True, exclude_unset=True).encode()
    else:
        data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands over ``body`` (read already, to see the method) and then passes on to ``receive``."""
    sent = False

    async def replayed() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


# -- the process --------------------------------------------------------------------------------------------------


def serve(argv: Sequence[str] | None = None) -> None:
    """``python -m rlfabric.mcp_stdio_gateway --port PORT [--host HOST] [--idle-timeout S] -- COMMAND ...``: serve
    until SIGTERM or SIGINT, then stop every child."""
    import uvicorn

    from rlfabric.mcp_tools import server_command

    parser = argparse.ArgumentParser(
        prog="python -m rlfabric.mcp_stdio_gateway",
        description="Serve a stdio MCP server over streamable HTTP at /mcp, one child process per session.",
    )
    parser.add_argument("--port", type=int, required=True, help="port to serve on")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        help=f"end a session that has no request for this many seconds (default {DEFAULT_IDLE_TIMEOUT_S:g})",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the stdio server's command line, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the stdio server's command after --, e.g. -- python -m rlfabric.envs.notes_server")
    gateway = StdioGateway(server_command(command), args.idle_timeout)
    config = uvicorn.Config(
        gateway,
        host=args.host,
        port=args.port,
        lifespan="on",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,
    )
    uvicorn.Server(config).run()


if __name__ == "__main__":
    serve()
