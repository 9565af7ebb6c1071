"""An MCP server serving streamable HTTP in its own process, for the tests that need one running."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def module_over_http(module: str, timeout_s: float = 30.0) -> Iterator[str]:
    """``python -m module --http PORT`` on a free port, until it accepts connections; its URL; killed after."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            break
        except OSError:
            time.sleep(0.2)
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.kill()
        process.wait()
