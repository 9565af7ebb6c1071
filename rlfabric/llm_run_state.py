"""A GRPO run's files and counters: checkpoint folders, the driver state a resumed run reads, the KL reference.

Pure bookkeeping over the run directory (``rlfabric.run.checkpoints`` does the folders): the driver writes
``TRAINER_STATE_FILE`` last into each checkpoint, and ``--resume`` reads it back with ``read_trainer_state``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfabric.config import ConfigError
from rlfabric.run.checkpoints import CHECKPOINT_DIR, CheckpointStore
from rlfabric.run.log import CONFIG_FILE
from rlfabric.run.resume import finished_training, no_checkpoint_error, resumed_config, saved_config

TRAINER_STATE_FILE = "trainer_state.json"  # written last: a checkpoint without it is incomplete
REFERENCE_MODEL_DIR = "reference_model"  # the KL reference after an SFT warm-up, kept for --resume
FINAL_MODEL_DIR = "final_model"
INITIAL_MODEL_DIR = "initial_model"  # the builtin model, as built for the run
SAMPLES_FILE = "samples.jsonl"
# What a checkpoint's weights and the data order depend on: a resumed run may not change these.
FIXED_ON_RESUME = (
    "algo",
    "model.path",
    "model.builtin",
    "model.dtype",
    "data.train",
    "data.num_train",
    "data.prompt_key",
    "data.chat_template",
    "training.seed",
)


@dataclass
class Counters:
    step: int = 0  # GRPO optimizer steps (the policy version counts SFT steps too)
    samples: int = 0
    tokens_generated: int = 0
    failed_samples: int = 0
    stale_samples: int = 0
    filtered_groups: int = 0
    generator_restarts: int = 0
    rollout_worker_restarts: int = 0
    reward_worker_restarts: int = 0
    resampled_samples: int = 0  # samples whose rollout a failed generator or rollout worker lost, asked again
    trained_samples: int = 0


def not_final(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row kept by a resumed run: its earlier session's "final" evaluation is an evaluation at that
    step now (the resumed run ends with its own "final")."""
    return {**row, "label": f"step_{row['step']}"} if row.get("label") == "final" else row


def checkpoints(run_dir: Path) -> CheckpointStore:
    """A GRPO run's checkpoints: one Hugging Face model folder per step, complete once its driver state is in."""
    return CheckpointStore(run_dir, "step", marker=TRAINER_STATE_FILE)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder of a GRPO run (None when there is none)."""
    return checkpoints(Path(run_dir)).latest()


def reference_entry(reference_dir: str | None, run_dir: Path) -> dict[str, Any] | None:
    """Where a checkpoint records the KL reference model: relative to the run directory when inside it (run
    folders move), else as given (a hub id, or an absolute folder); None when there is none."""
    if reference_dir is None:
        return None
    path = Path(reference_dir)
    local = path.exists()  # else a hub id, stored as given
    resolved, run = (path.resolve() if local else path), Path(run_dir).resolve()
    inside = local and resolved.is_relative_to(run)
    return {"path": str(resolved.relative_to(run) if inside else resolved), "in_run": inside}


def reference_path(entry: dict[str, Any] | None, run_dir: Path) -> str | None:
    """The KL reference model's path from a checkpoint's ``reference_entry``, for the run now in ``run_dir``."""
    if entry is None:
        return None
    return str(Path(run_dir) / entry["path"]) if entry["in_run"] else entry["path"]


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / TRAINER_STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--resume: {str(path)!r} cannot be read ({exc}); delete that checkpoint folder") from None
    if not isinstance(state, dict) or "step" not in state.get("counters", {}):
        raise ConfigError(
            f"--resume: {str(checkpoint)!r} has no driver state (an older rlfabric wrote it); start a new run from "
            f"its weights with model.path={checkpoint}"
        )
    return state


def saved_reward_weights(run_dir: Path) -> dict[str, float] | None:
    """``rewards.weights`` as the run in ``run_dir`` saved them (None when its config cannot be read)."""
    try:
        weights = ((saved_config(run_dir) or {}).get("rewards") or {}).get("weights") or {}
        return {str(k): float(v) for k, v in weights.items()}
    except (AttributeError, TypeError, ValueError):  # not mappings of numbers: loading the config names it
        return None


def weights_saved_before_declarations(saved: dict[str, float], declared: dict[str, float]) -> dict[str, float]:
    """The weights a resumed run trained with, from its saved ``rewards.weights`` and the weights its reward
    functions declare (``@default_weights``). A run saves every declared weight since functions declare them; one
    saved before weighed a component its config left out 1, and keeps that weight. Its ``format: 0.0`` that no
    function declares was the config's former default, naming a component no reward gave: dropped."""
    kept = {k: v for k, v in saved.items() if not (k == "format" and v == 0.0 and "format" not in declared)}
    return {**{name: 1.0 for name in declared}, **kept}


def resume_point(run_dir: Path, overrides: list[str] | None) -> tuple[Any, Path]:
    """(the config, the checkpoint) a ``--resume`` of the GRPO run in ``run_dir`` continues from: the saved config
    with ``overrides`` (never the fields in ``FIXED_ON_RESUME``) and the latest complete checkpoint; a ConfigError
    in one line when the folder is no run, has no checkpoint, lacks a model folder it needs, or the overrides ask
    for what the checkpoint cannot give."""
    if not (run_dir / CONFIG_FILE).is_file():
        raise ConfigError(f"--resume {str(run_dir)!r}: not a run directory (no {CONFIG_FILE})")
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise no_checkpoint_error(run_dir, CHECKPOINT_DIR)
    cfg = resumed_config(run_dir, overrides, FIXED_ON_RESUME)
    state = read_trainer_state(checkpoint)
    needed = [run_dir / INITIAL_MODEL_DIR] if cfg.model.path == "builtin" else []
    reference = state.get("reference_model")
    if reference and reference["in_run"]:
        needed.append(run_dir / reference["path"])
    for folder in needed:
        if not folder.is_dir():
            raise ConfigError(f"--resume {str(run_dir)!r}: {folder.name}/ is missing from the run directory")
    step, total = state["counters"]["step"], cfg.training.total_steps
    # At the total, a run that stopped before it finished (Ctrl-C in its last step, a crash in its final
    # evaluation) only finishes; one that finished has nothing left to do.
    if step == total and finished_training(run_dir):
        raise ConfigError(
            f"--resume {str(run_dir)!r}: the run finished at step {step} of {total} (its latest checkpoint, "
            f"{checkpoint.name}); pass training.total_steps=N with N > {step} to train longer"
        )
    if step > total:
        raise ConfigError(
            f"training.total_steps = {total} is not valid with --resume: the latest checkpoint ({checkpoint.name}) is "
            f"at step {step} already; pass training.total_steps=N with N > {step}"
        )
    if cfg.grpo.kl_coef > 0 and reference is None:
        raise ConfigError(
            f"grpo.kl_coef = {cfg.grpo.kl_coef} is not valid with --resume: this run saved no KL reference model "
            "(it trained without a KL term after an SFT warm-up)"
        )
    return cfg, checkpoint
