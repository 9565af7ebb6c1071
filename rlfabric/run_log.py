"""A run's outputs: resolved config, metrics.jsonl, TensorBoard events, progress line, plot and summary."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfabric.config import dump_config

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
PLOT_FILE = "learning_curve.png"
SUMMARY_FILE = "summary.json"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunLog:
    def __init__(
        self,
        run_dir: Path,
        cfg: Any,
        resume_at: int | None = None,
        quiet: bool = False,
        step_key: str = "env_steps",
        progress_line: Callable[[dict[str, Any]], str] | None = None,
        relabel: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        tensorboard_view: Callable[[dict[str, Any]], tuple[int, dict[str, float]]] | None = None,
    ) -> None:
        """Start a run's outputs; ``resume_at`` (a checkpoint's iteration) keeps the metrics up to it, each
        kept row passed through ``relabel`` when given.

        ``step_key`` is the row field TensorBoard uses as its x axis; ``tensorboard_view`` may instead map a row to
        (x, {tag: value}) (default: ``step_key`` and every number); ``progress_line`` formats a row for the
        terminal (default: the PPO line).
        """
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / CONFIG_FILE).write_text(dump_config(cfg))
        kept = [r for r in read_metrics(run_dir) if r["iteration"] <= resume_at] if resume_at is not None else []
        kept = [relabel(r) for r in kept] if relabel else kept
        # Rows logged after the checkpoint are redone by the resumed run; drop them so none appear twice.
        (run_dir / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.metrics_file = open(run_dir / METRICS_FILE, "a")  # noqa: SIM115 - kept open for the run
        from torch.utils.tensorboard import SummaryWriter

        # On resume, purge the TensorBoard events written after the checkpoint.
        self.step_key = step_key
        purge_step = (kept[-1][step_key] if kept else 0) + 1 if resume_at is not None else None
        self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge_step)
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.last_print = 0.0
        self.total_env_steps = getattr(cfg.training, "total_env_steps", 0)
        self.progress_line = progress_line or self._ppo_line
        self.tensorboard_view = tensorboard_view or self._scalars

    def log(self, row: dict[str, Any], show: bool = True) -> None:
        clean = {k: _jsonable(v) for k, v in row.items()}
        self.metrics_file.write(json.dumps(clean) + "\n")
        self.metrics_file.flush()
        step, scalars = self.tensorboard_view(row)
        for key, value in scalars.items():
            self.tb.add_scalar(key, value, step)
        if show:
            self.progress(row)

    def _scalars(self, row: dict[str, Any]) -> tuple[int, dict[str, float]]:
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return int(row[self.step_key]), {k: v for k, v in numbers.items() if k != self.step_key}

    def _ppo_line(self, row: dict[str, Any]) -> str:
        ret = row.get("episode_return_mean")
        pct = 100.0 * row["env_steps"] / self.total_env_steps
        return (
            f"iter {row['iteration']:>4} | env steps {row['env_steps']:>10,} ({pct:5.1f}%) | "
            f"{row['env_steps_per_s']:>8,.0f} steps/s | return {'   n/a' if ret is None else f'{ret:9.2f}'} | "
            f"v{row['policy_version']} dropped {row['dropped_fragments']} restarts {row['runner_restarts']}"
        )

    def progress(self, row: dict[str, Any]) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if not self.tty and now - self.last_print < 2.0:  # a log file gets a line every 2 s at most
            return
        self.last_print = now
        line = self.progress_line(row)
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def note(self, message: str) -> None:
        """A one-off event (a replaced runner) on its own line, between progress lines."""
        if not self.quiet:
            print(("\n" if self.tty else "") + f"rlfabric: {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty and not self.quiet:
            print(file=sys.stderr)
        self.metrics_file.close()
        self.tb.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
            continue
    return rows


def plot_learning_curve(run_dir: Path, title: str) -> Path | None:
    """env steps vs episode_return_mean, as a PNG; None when there is nothing to plot."""
    rows = [r for r in read_metrics(run_dir) if r.get("episode_return_mean") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["env_steps"] for r in rows], [r["episode_return_mean"] for r in rows], lw=1.5)
    ax.set_xlabel("env steps")
    ax.set_ylabel("episode return (mean)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = run_dir / PLOT_FILE
    fig.savefig(path)
    plt.close(fig)
    return path


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    (run_dir / SUMMARY_FILE).write_text(json.dumps({k: _jsonable(v) for k, v in summary.items()}, indent=2) + "\n")
