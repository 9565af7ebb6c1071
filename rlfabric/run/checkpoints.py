"""Numbered checkpoints in a run directory: where each goes, which are complete, the latest, pruning.

A checkpoint is complete once its last piece is in place: a file written under a temporary name and renamed, or
a folder whose marker file (written last, atomically) exists. Anything else was left by a crash: it is never
resumed from and is removed at the next pruning.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

CHECKPOINT_DIR = "checkpoints"


class CheckpointStore:
    def __init__(self, run_dir: Path, prefix: str, suffix: str = "", marker: str | None = None) -> None:
        """Checkpoints ``<run_dir>/checkpoints/<prefix>_<NNNNNN><suffix>``; ``marker``: a folder checkpoint is
        complete when it holds this file (None: a file checkpoint, complete once it exists)."""
        self.folder = Path(run_dir) / CHECKPOINT_DIR
        self.prefix, self.suffix, self.marker = prefix, suffix, marker

    def path(self, number: int) -> Path:
        return self.folder / f"{self.prefix}_{number:06d}{self.suffix}"

    def _all(self) -> list[Path]:
        return sorted(self.folder.glob(f"{self.prefix}_*{self.suffix}"))

    def is_complete(self, path: Path) -> bool:
        return path.is_file() if self.marker is None else (path / self.marker).is_file()

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return [p for p in self._all() if self.is_complete(p)]

    def latest(self) -> Path | None:
        """The newest complete checkpoint (None when there is none)."""
        found = self.complete()
        return found[-1] if found else None

    def write_atomically(self, path: Path, write: Callable[[Path], None]) -> Path:
        """``write(tmp)`` then rename ``tmp`` to ``path``: a reader never sees half of it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        write(tmp)
        os.replace(tmp, path)
        return path

    def prune(self, keep: int) -> None:
        """Keep the newest ``keep`` complete checkpoints (0: all); remove incomplete ones."""
        every = self._all()
        complete = [p for p in every if self.is_complete(p)]
        stale = complete[: max(0, len(complete) - keep)] if keep else []
        for old in [*stale, *(p for p in every if p not in complete)]:
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
