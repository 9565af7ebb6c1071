"""Resuming a run: its saved config with the user's overrides, refusing what its checkpoint cannot follow."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from rlfabric.config import ConfigError, load_config
from rlfabric.run.log import CONFIG_FILE, SUMMARY_FILE, read_metrics
from rlfabric.run.paths import same_setting

# Rows a reward model's training logs (``rlfabric train-rm``, or a GRPO run's first stage): a new run in the same
# directory reuses that model rather than writing over a run.
REWARD_MODEL_PHASES = frozenset({"rm_lm", "rm", "rm_eval"})
# Rows that train nothing: a GRPO run's evaluations (its first row is the ``initial`` one, before any training) and
# the reward model's. Training rows are GRPO's ``sft`` and ``grpo`` rows and PPO's (and games') iteration rows,
# which have no phase.
NOT_TRAINING_PHASES = REWARD_MODEL_PHASES | {"eval"}

# Defaults that changed: a GRPO run saved before its config held the key trained with the former value, and resumes
# with it unless an override says otherwise ({section: {key: former value}}).
FORMER_GRPO_DEFAULTS = {"grpo": {"lr_schedule": "constant"}}  # linear decay became the default later


def refuse_run_over(run_dir: Path, has_checkpoint: bool) -> None:
    """A new run must not write over one in ``run_dir``: one that logged a training row, finished (a summary with
    ``algo`` or ``env``), or left a checkpoint (``has_checkpoint``). A directory left by a run that stopped before
    its first training row (with only its ``initial`` evaluation, say), or holding only a trained reward model, is
    reused."""
    if not (has_checkpoint or trained_there(run_dir)):
        return
    how = (
        f": continue it with --resume {str(run_dir)!r}, choose another directory, or delete it"
        if has_checkpoint
        else " (it has no checkpoint to resume): choose another directory or delete it"
    )
    raise ConfigError(f"--run-dir {str(run_dir)!r} already holds a run{how}")


def trained_there(run_dir: Path) -> bool:
    """Whether a run in ``run_dir`` logged a training row (see ``NOT_TRAINING_PHASES``) or finished."""
    trained = any(row.get("phase") not in NOT_TRAINING_PHASES for row in read_metrics(run_dir))
    return trained or finished_training(run_dir)


def saved_config(run_dir: Path) -> dict[str, Any] | None:
    """The run's config file as saved, a raw mapping, for the few keys read before the config is loaded and
    checked; None when it cannot be read or is not a mapping (loading it then names the problem)."""
    try:
        saved = yaml.safe_load((run_dir / CONFIG_FILE).read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return saved if isinstance(saved, dict) else None


def no_checkpoint_error(run_dir: Path, checkpoint_dir: str, zero_saves_at_end: bool = False) -> ConfigError:
    """The one line for ``--resume`` of a run that left no checkpoint, saying why from its saved config: it ran
    with ``training.checkpoint_every: 0`` (which saves none, or with ``zero_saves_at_end`` only the last, as PPO
    does), or it stopped before its first checkpoint."""
    training = (saved_config(run_dir) or {}).get("training")
    every = training.get("checkpoint_every") if isinstance(training, dict) else None
    why = (
        "the run stopped before its end, the only checkpoint training.checkpoint_every: 0 saves"
        if every == 0 and zero_saves_at_end
        else "the run was started with training.checkpoint_every: 0, which saves none"
        if every == 0
        else f"the run stopped before its first (training.checkpoint_every: {every})"
        if every is not None
        else "the run stopped before its first"
    )
    return ConfigError(f"--resume {str(run_dir)!r}: no checkpoint found under {checkpoint_dir}/: {why}")


def finished_training(run_dir: Path) -> bool:
    """Whether a training run finished in ``run_dir`` (see ``finished_summary``)."""
    return finished_summary(run_dir) is not None


def finished_summary(run_dir: Path) -> dict[str, Any] | None:
    """The summary of the training run that finished in ``run_dir`` (PPO's names its env, GRPO's its algo;
    train-rm's does neither), ``{}`` when it cannot be read; None when none finished there (a run stopped before
    its end, by Ctrl-C or a crash in its final evaluation, wrote none)."""
    summary = run_dir / SUMMARY_FILE
    if not summary.is_file():
        return None
    try:
        found = json.loads(summary.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}  # unreadable: assume the worst
    if not isinstance(found, dict):
        return {}
    return found if "algo" in found or "env" in found else None


def _get_path(cfg: Any, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def resumed_config(run_dir: Path, overrides: list[str] | None, fixed: tuple[str, ...]) -> Any:
    """The config saved in ``run_dir`` with ``overrides`` applied, refusing changes to the ``fixed`` paths (what
    the checkpoint's weights depend on); the error names the changed field, e.g. ``model.hidden_sizes``."""
    former = former_defaults(run_dir)
    saved = load_config(run_dir / CONFIG_FILE, former)
    cfg = load_config(run_dir / CONFIG_FILE, [*former, *(overrides or [])])
    for path in fixed:
        before, after = _get_path(saved, path), _get_path(cfg, path)
        if dataclasses.is_dataclass(before) and before != after:
            changed = next(
                (
                    f.name
                    for f in dataclasses.fields(before)
                    if not same_setting(getattr(before, f.name), getattr(after, f.name))
                ),
                None,
            )
            if changed is None:  # only spellings of the same local paths differ
                continue
            path, before, after = f"{path}.{changed}", getattr(before, changed), getattr(after, changed)
        if not same_setting(before, after):
            raise ConfigError(
                f"{path} = {after!r} is not valid with --resume: the checkpoint was trained with {before!r}"
            )
    return cfg


def former_defaults(run_dir: Path) -> list[str]:
    """Overrides that give a saved GRPO config the former default of each key in ``FORMER_GRPO_DEFAULTS`` it does
    not hold (a run saved before the key existed)."""
    saved = saved_config(run_dir)
    if saved is None or saved.get("algo", "grpo") != "grpo":  # unreadable: load_config names the file's problem
        return []
    return [
        f"{section}.{key}={value}"
        for section, keys in FORMER_GRPO_DEFAULTS.items()
        for key, value in keys.items()
        if key not in (saved.get(section) or {})
    ]
