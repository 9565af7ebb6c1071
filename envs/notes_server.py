"""A stateful MCP tool server: a notes store, on the ``mcp`` SDK's server API (``MCPServer``), over stdio.

Each process holds one store and serves one session (stdio), so what one episode writes no other sees. Tools:
``put(key, value)``, ``get(key)``, ``delete(key)``, ``keys()``; a missing key is a tool error (``is_error``) whose
message names it. Run it as ``python -m rlfabric.envs.notes_server``; ``McpToolEnv`` starts one per episode.
"""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("notes")
NOTES: dict[str, str] = {}


@server.tool()
def put(key: str, value: str) -> str:
    """Store value under key, replacing what was there."""
    NOTES[key] = value
    return "ok"


@server.tool()
def get(key: str) -> str:
    """The value stored under key."""
    if key not in NOTES:
        raise ToolError(f"no note {key!r}")
    return NOTES[key]


@server.tool()
def delete(key: str) -> str:
    """Remove the note under key."""
    if NOTES.pop(key, None) is None:
        raise ToolError(f"no note {key!r}")
    return "ok"


@server.tool()
def keys() -> str:
    """The stored keys, comma-separated, in the order they were first stored."""
    return ",".join(NOTES)


if __name__ == "__main__":
    server.run()
