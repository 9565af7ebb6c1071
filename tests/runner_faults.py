"""Killing a runner process mid-run, for the fault tests of PPO and of games."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import ray


def kill_runner_after(trainer: Any, run_dir: Path, rows: int, index: int = 1) -> tuple[threading.Thread, list[int]]:
    """A started thread that SIGKILLs runner ``index`` of ``trainer`` once ``metrics.jsonl`` has ``rows`` rows;
    the list gets the killed pid."""
    killed: list[int] = []

    def kill() -> None:
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= rows):
            time.sleep(0.05)
        pid = ray.get(trainer.pool.runners[index].pid.remote())
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread, killed
