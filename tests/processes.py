"""Processes a test started, told apart from those of tests running beside it (pytest-xdist workers)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def own_processes(pattern: str) -> list[int]:
    """The pids ``pgrep -f pattern`` finds that this test process started (directly or through Ray's actors): under
    xdist, those carrying this worker's ``PYTEST_XDIST_WORKER`` in their environment, so another worker's servers
    are neither counted nor killed. A process left behind keeps its environment, so a leak is still found."""
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return [int(pid) for pid in found]
    mark = f"PYTEST_XDIST_WORKER={worker}".encode()
    mine = []
    for pid in found:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if mark in environ:
            mine.append(int(pid))
    return mine
