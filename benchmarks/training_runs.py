"""What the learning benchmarks share: one ``rlfabric train`` run in a subprocess, its metrics rows and wall time;
and their side-by-side plot, one panel per curve, every run a line."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rlfabric.run.plots import pyplot


def train_run(config: str, overrides: list[str], run_dir: Path) -> tuple[list[dict], float]:
    """``rlfabric train CONFIG OVERRIDES --run-dir RUN_DIR --quiet`` in a subprocess (an error stops the
    benchmark); the run's metrics.jsonl rows and its wall-clock seconds."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "rlfabric.cli", "train", config, *overrides, "--run-dir", str(run_dir), "--quiet"]
    subprocess.run(command, check=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, time.perf_counter() - started


def plot_panels(
    runs: dict[str, dict[str, list]], panels: Sequence[tuple[str, str, str]], title: str, path: Path
) -> None:
    """One panel per (x key, y key, panel title) of ``panels``, each run of ``runs`` (label -> curves) a line in
    every panel (held-out evaluations, whose x key is ``eval_steps``, with markers), saved as a PNG at ``path``."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 4))
    for label, curves in runs.items():
        for ax, (x, y, _) in zip(axes, panels, strict=True):
            ax.plot(curves[x], curves[y], marker="o" if x == "eval_steps" else None, label=label)
    for ax, (_, _, panel_title) in zip(axes, panels, strict=True):
        ax.set_title(panel_title)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
