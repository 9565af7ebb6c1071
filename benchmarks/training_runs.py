"""What the learning benchmarks share: one ``rlfabric train`` run in a subprocess, its metrics rows and wall time."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


def train_run(config: str, overrides: list[str], run_dir: Path) -> tuple[list[dict], float]:
    """``rlfabric train CONFIG OVERRIDES --run-dir RUN_DIR --quiet`` in a subprocess (an error stops the
    benchmark); the run's metrics.jsonl rows and its wall-clock seconds."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "rlfabric.cli", "train", config, *overrides, "--run-dir", str(run_dir), "--quiet"]
    subprocess.run(command, check=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, time.perf_counter() - started
