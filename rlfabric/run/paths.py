"""Local paths in a run's saved config: recorded absolute, so ``--resume`` works from any directory.

A config names files and folders as the user typed them (``model.path: mymodel``, ``data.train: train.jsonl``),
relative to the directory the run started in. ``config.yaml`` records them resolved against that directory; hub
ids, ``builtin``, ``task:`` specs and anything else that is not a local file or folder stay as typed.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

# Keys whose string values may name a local file or folder: model.path, data.train / data.eval, a reward model's
# preference pairs, a reward function's or judge's model folder.
PATH_KEYS = frozenset({"path", "train", "eval", "pairs", "model", "model_dir"})


def local_path(value: str) -> Path | None:
    """``value`` as an absolute path when it names an existing local file or folder, or is a glob pattern that
    matches some (``data.train: shards/*.parquet``), relative to the current directory (None otherwise: absolute
    already, a hub id, a spec)."""
    if not value or Path(value).is_absolute():
        return None
    if glob.has_magic(value):
        return Path(value).absolute() if glob.glob(value) else None  # the pattern kept, its directory resolved
    return Path(value).resolve() if Path(value).exists() else None


def with_local_paths_resolved(data: Any) -> Any:
    """A copy of a config mapping in which every ``PATH_KEYS`` value that names a local file or folder relative
    to the current directory is absolute (lists and nested mappings walked)."""
    if isinstance(data, dict):
        out = {}
        for key, value in data.items():
            found = local_path(value) if key in PATH_KEYS and isinstance(value, str) else None
            out[key] = str(found) if found is not None else with_local_paths_resolved(value)
        return out
    if isinstance(data, list):
        return [with_local_paths_resolved(v) for v in data]
    return data


def same_setting(before: Any, after: Any) -> bool:
    """Whether two values of a config key are the same setting: equal, or two spellings of one local path."""
    if before == after:
        return True
    if isinstance(before, str) and isinstance(after, str) and Path(before).exists() and Path(after).exists():
        return Path(before).resolve() == Path(after).resolve()
    return False
