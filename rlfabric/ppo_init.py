"""A new PPO run that starts from another run's checkpoint (``model.init_from``): curricula, fine-tuning on a
changed env, a longer schedule with fresh settings.

The new run takes the checkpoint's policy and value weights and the statistics they were trained with (the
observation normalizer, without which the weights see other inputs, and the return and value normalizers the value
head's scale comes from). It starts its own optimizer, counters, learning-rate schedule and random streams. What
can be known before Ray starts is checked then (the file, that it is a PPO checkpoint, the network's shape); that
the env's observation and action sizes fit the weights is known once the runners report the spaces, and is one
line then (``LearnerCore.init_from``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rlfabric.config import Config, ConfigError
from rlfabric.run.checkpoints import CHECKPOINT_DIR, CheckpointStore

FIELD = "model.init_from"
# What a new run takes from the checkpoint's learner state (rlfabric.actors.learner.LearnerCore.state)
CARRIED = ("model", "obs_stats", "return_stats", "value_stats")


def init_checkpoint(value: str) -> Path:
    """The checkpoint ``model.init_from`` names: a checkpoint file, or a run directory (its latest checkpoint)."""
    path = Path(value).expanduser()
    if path.is_dir():
        latest = CheckpointStore(path, "iter", ".pt").latest()
        if latest is None:
            raise ConfigError(f"{FIELD} = {value!r}: the folder holds no PPO checkpoint ({CHECKPOINT_DIR}/iter_*.pt)")
        return latest
    if not path.is_file():
        raise ConfigError(f"{FIELD} = {value!r}: no such file or run directory")
    return path


def read_init_state(cfg: Config) -> dict[str, Any] | None:
    """The learner state a new run starts from (``CARRIED`` of the checkpoint's), or None without
    ``model.init_from``; a ConfigError naming the field when the file is not a PPO checkpoint or its network's
    hidden sizes or activation differ from ``model``'s."""
    value = cfg.model.init_from
    if not value:
        return None
    path = init_checkpoint(value)
    try:
        state = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same one line
        raise ConfigError(f"{FIELD} = {value!r}: {path} could not be read: {exc.__class__.__name__}") from None
    learner = state.get("learner") if isinstance(state, dict) else None
    if not isinstance(learner, dict) or "model" not in learner:
        raise ConfigError(f"{FIELD} = {value!r}: {path} is not a PPO checkpoint (a single-agent run's iter_*.pt)")
    saved = state.get("config", {}).get("model", {})
    for key in ("hidden_sizes", "activation"):
        if key in saved and saved[key] != getattr(cfg.model, key):
            raise ConfigError(
                f"{FIELD} = {value!r}: its network has model.{key} = {saved[key]!r}, this run's model.{key} is "
                f"{getattr(cfg.model, key)!r}; set it to the checkpoint's"
            )
    return {key: learner[key] for key in CARRIED if key in learner} | {"source": str(path)}
