"""An MCP server for the tests: tools that answer, hang, raise, and kill the server (stdio)."""

from __future__ import annotations

import asyncio
import os

from mcp.server.mcpserver import MCPServer

server = MCPServer("faulty")


@server.tool()
def echo(text: str) -> str:
    """Return text."""
    return text


@server.tool()
async def wait(seconds: float) -> str:
    """Answer after seconds."""
    await asyncio.sleep(seconds)
    return "waited"


@server.tool()
def crash() -> str:
    """Raise."""
    raise RuntimeError("the tool broke")


@server.tool()
def die() -> str:
    """End the server process."""
    os._exit(1)


if __name__ == "__main__":
    server.run()
