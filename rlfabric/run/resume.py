"""Resuming a run: its saved config with the user's overrides, refusing what its checkpoint cannot follow."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rlfabric.config import ConfigError, load_config
from rlfabric.run.log import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE


def refuse_run_over(run_dir: Path, has_checkpoint: bool) -> None:
    """A new run must not write over one in ``run_dir``: one that logged a step, finished, or left a checkpoint
    (``has_checkpoint``). A directory left by a run that stopped before its first step is reused."""
    logged = (run_dir / METRICS_FILE).is_file() and (run_dir / METRICS_FILE).stat().st_size > 0
    if not (has_checkpoint or logged or (run_dir / SUMMARY_FILE).is_file()):
        return
    how = f"continue it with --resume {str(run_dir)!r}, or" if has_checkpoint else "it has no checkpoint to resume;"
    raise ConfigError(f"--run-dir {str(run_dir)!r} already holds a run: {how} choose another directory")


def _get_path(cfg: Any, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def resumed_config(run_dir: Path, overrides: list[str] | None, fixed: tuple[str, ...]) -> Any:
    """The config saved in ``run_dir`` with ``overrides`` applied, refusing changes to the ``fixed`` paths (what
    the checkpoint's weights depend on); the error names the changed field, e.g. ``model.hidden_sizes``."""
    saved = load_config(run_dir / CONFIG_FILE)
    cfg = load_config(run_dir / CONFIG_FILE, overrides)
    for path in fixed:
        before, after = _get_path(saved, path), _get_path(cfg, path)
        if dataclasses.is_dataclass(before) and before != after:
            changed = next(
                f.name for f in dataclasses.fields(before) if getattr(before, f.name) != getattr(after, f.name)
            )
            path, before, after = f"{path}.{changed}", getattr(before, changed), getattr(after, changed)
        if before != after:
            raise ConfigError(
                f"{path} = {after!r} is not valid with --resume: the checkpoint was trained with {before!r}"
            )
    return cfg
