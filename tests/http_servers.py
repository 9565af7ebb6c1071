"""An MCP server serving streamable HTTP in its own process, for the tests that need one running."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rlfabric.mcp_server_process import free_port

__all__ = ["free_port", "module_over_http", "wait_for_port"]


def wait_for_port(port: int, timeout_s: float) -> None:
    """Until something accepts connections on 127.0.0.1:``port``, or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.2)


@contextmanager
def module_over_http(module: str, timeout_s: float = 30.0) -> Iterator[str]:
    """``python -m module --http PORT`` on a free port, until it accepts connections; its URL; killed after."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for_port(port, timeout_s)
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.kill()
        process.wait()
