"""A run's outputs: resolved config, metrics.jsonl, TensorBoard events, progress line, notes and summary."""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from rlfabric.run.paths import with_local_paths_resolved

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
ERRORS_FILE = "errors.log"  # the whole text (a remote traceback) of the first failure of each kind


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
        progress_line: Callable[[dict[str, Any]], str] = str,
        relabel: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        tensorboard_view: Callable[[dict[str, Any]], tuple[int, dict[str, float]]] | None = None,
    ) -> None:
        """Start a run's outputs; ``resume_at`` (a checkpoint's iteration) keeps the metrics up to it, each
        kept row passed through ``relabel`` when given.

        ``step_key`` is the row field TensorBoard uses as its x axis; ``tensorboard_view`` may instead map a row to
        (x, {tag: value}) (default: ``step_key`` and every number); ``progress_line`` formats a row for the
        terminal (each algorithm's: rlfabric.run.progress).
        """
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        # local paths absolute, so --resume works from any directory
        saved = with_local_paths_resolved(cfg.to_dict())
        (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(saved, sort_keys=False))
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
        self.failure_counts: dict[str, int] = {}  # failures said so far, by kind (``failure``)
        self.last_print = 0.0
        self.unshown: dict[str, Any] | None = None  # the newest row a log file did not get yet (printed before a note)
        self.progress_line = progress_line
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

    def progress(self, row: dict[str, Any]) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if not self.tty and now - self.last_print < 2.0:  # a log file gets a line every 2 s at most
            self.unshown = row
            return
        self._print(row, now)

    def _print(self, row: dict[str, Any], now: float) -> None:
        self.last_print, self.unshown = now, None
        line = self.progress_line(row)
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def _catch_up(self) -> None:
        """Print the newest row a log file skipped, so the last step before a note or the end is always shown."""
        if self.unshown is not None and not self.quiet:
            self._print(self.unshown, time.monotonic())

    def note(self, message: str) -> None:
        """A one-off event (a replaced runner) on its own line, between progress lines."""
        self._catch_up()
        if not self.quiet:
            print(("\n" if self.tty else "") + f"rlfabric: {message}", file=sys.stderr, flush=True)

    def failure(self, kind: str, line: str, text: str) -> None:
        """A failure (``line``, and its whole ``text``) of ``kind``: the first of each kind is said, its text
        appended to ``errors.log``; later ones are counted and said again at the 2nd, 4th, 8th, ... of their kind,
        so an env that fails one sample in ten does not fill the console."""
        count = self.failure_counts[kind] = self.failure_counts.get(kind, 0) + 1
        if count == 1:
            with open(self.run_dir / ERRORS_FILE, "a") as errors:
                plain = ANSI_ESCAPE.sub("", text).rstrip()  # Ray colours the remote frame's header
                errors.write(f"== {time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n{plain}\n\n")
            self.note(f"{line} (its whole error: {self.run_dir / ERRORS_FILE}; more of this kind are counted)")
        elif count & (count - 1) == 0:
            self.note(f"{line} ({count} failures of this kind so far)")

    def close(self) -> None:
        self._catch_up()
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


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    (run_dir / SUMMARY_FILE).write_text(json.dumps({k: _jsonable(v) for k, v in summary.items()}, indent=2) + "\n")
