"""A stateful MCP tool server: a notes store per session, on the ``mcp`` SDK's server API (``MCPServer``).

Over stdio (``python -m rlfabric.envs.notes_server``) a process serves one session; over streamable HTTP
(``--http PORT``) one process serves many, each with its own store under its ``mcp-session-id``, so what one
episode writes no other sees either way. Tools: ``put(key, value)``, ``get(key)``, ``delete(key)``, ``keys()``; a
missing key is a tool error (``is_error``) whose message names it. ``McpToolEnv`` opens a session per episode.
"""

from __future__ import annotations

import argparse

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("notes")
STORES: dict[str | None, dict[str, str]] = {}  # by HTTP session id; None for the one stdio session


def notes(ctx: Context) -> dict[str, str]:
    """This session's store."""
    return STORES.setdefault((ctx.headers or {}).get("mcp-session-id"), {})


@server.tool()
def put(key: str, value: str, ctx: Context) -> str:
    """Store value under key, replacing what was there."""
    notes(ctx)[key] = value
    return "ok"


@server.tool()
def get(key: str, ctx: Context) -> str:
    """The value stored under key."""
    store = notes(ctx)
    if key not in store:
        raise ToolError(f"no note {key!r}")
    return store[key]


@server.tool()
def delete(key: str, ctx: Context) -> str:
    """Remove the note under key."""
    if notes(ctx).pop(key, None) is None:
        raise ToolError(f"no note {key!r}")
    return "ok"


@server.tool()
def keys(ctx: Context) -> str:
    """The stored keys, comma-separated, in the order they were first stored."""
    return ",".join(notes(ctx))


def main() -> None:
    parser = argparse.ArgumentParser(description="A notes store as an MCP server (stdio, or streamable HTTP).")
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT")
    args = parser.parse_args()
    if args.http is None:
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
