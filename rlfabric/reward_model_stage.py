"""The reward-model stage of a run: with ``reward_model.pairs`` set, a GRPO run first trains its reward model (a
Bradley-Terry classifier, ``rlfabric.reward_model_training``) or its generative judge
(``rlfabric.judge_training``) into ``RUN_DIR/reward_model``, and the reward specs that leave their model out serve
it; ``rlfabric train-rm`` runs this stage alone."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlfabric.config import ConfigError
from rlfabric.judge_training import train_judge
from rlfabric.reward_model_training import train_reward_model

REWARD_MODEL_DIR = "reward_model"  # where a run keeps the reward model (or judge) it trained
# The reward specs that serve the run's own model when their model argument is left out, by reward_model.kind.
RUN_MODEL_SPECS = {"classifier": ("reward_model", "path"), "judge": ("judge", "model")}


def run_reward_model_specs(functions: Sequence[Any]) -> list[int]:
    """The indices of ``rewards.functions`` entries that mean the run's own model: ``reward_model`` without a
    ``path``, ``judge`` without a ``model``."""
    return [
        i
        for i, f in enumerate(functions)
        for name, key in RUN_MODEL_SPECS.values()
        if f.name == name and not f.kwargs.get(key)
    ]


def point_at_run_reward_model(cfg: Any, run_dir: Path) -> list[int]:
    """With ``reward_model.pairs`` set, give every spec that means the run's own model (``run_reward_model_specs``)
    the folder ``ensure_reward_model`` trains it in (``run_dir/reward_model``); the indices it changed. A spec of
    the other kind (a judge without a model when the run trains a classifier) is a ConfigError."""
    if not cfg.reward_model.pairs:
        return []
    kind = cfg.reward_model.kind
    name, key = RUN_MODEL_SPECS[kind]
    indices = run_reward_model_specs(cfg.rewards.functions)
    for i in indices:
        spec = cfg.rewards.functions[i]
        if spec.name != name:
            raise ConfigError(
                f"rewards.functions[{i}] = {spec.name!r} without its model serves the run's own model, which is a "
                f"{kind} (reward_model.kind): give it a model, or set reward_model.kind to "
                f"{'judge' if kind == 'classifier' else 'classifier'}"
            )
        spec.kwargs[key] = str(run_dir / REWARD_MODEL_DIR)
    return indices


def ensure_reward_model(cfg: Any, run_dir: Path, tokenizer: Any, log: Callable[[dict[str, Any]], None]) -> Path | None:
    """The run's reward model folder, trained now from ``reward_model.pairs`` unless it is there already (a
    resumed run keeps the one it trained); None when the config trains none. It is trained in a folder of its own
    and renamed when complete, so a stage cut short leaves no folder a resumed run would take for a model."""
    if not cfg.reward_model.pairs:
        return None
    folder = run_dir / REWARD_MODEL_DIR
    if not (folder / "config.json").is_file():
        b, rm = cfg.model.builtin, cfg.reward_model
        sizes = dataclasses.replace(
            b, num_layers=rm.num_layers or b.num_layers, hidden_size=rm.hidden_size or b.hidden_size
        )
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        common = {"base": cfg.model.path, "builtin": sizes, "tokenizer": tokenizer, "out_dir": partial, "log": log}
        if rm.kind == "judge":
            train_judge(rm, seed=cfg.training.seed, max_candidates=cfg.grpo.group_size, **common)
        else:
            train_reward_model(rm, seed=cfg.training.seed, **common)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)
    return folder


def policy_tokenizer(cfg: Any) -> Any:
    """The tokenizer of ``model.path`` (the builtin character tokenizer of ``model.builtin.alphabet``): the reward
    model reads text the way the policy writes it."""
    from rlfabric.grpo_config import builtin_alphabet
    from rlfabric.models.hf import build_char_tokenizer, load_tokenizer

    if cfg.model.path == "builtin":
        return build_char_tokenizer(builtin_alphabet(cfg.model.builtin.alphabet))
    return load_tokenizer(cfg.model.path)


def check_reward_model_run(cfg: Any, run_dir: Path) -> None:
    """What ``rlfabric train-rm`` needs before it starts: preference pairs to train on, and a ``run_dir`` that
    holds neither a reward model nor a training run (a ConfigError in one line)."""
    from rlfabric.run.checkpoints import CHECKPOINT_DIR
    from rlfabric.run.resume import refuse_run_over

    if not cfg.reward_model.pairs:
        raise ConfigError("reward_model.pairs = '' is not valid for train-rm: name the preference pairs to train on")
    if (run_dir / REWARD_MODEL_DIR / "config.json").is_file():
        raise ConfigError(f"--run-dir {str(run_dir)!r} already holds a reward model; choose another directory")
    refuse_run_over(run_dir, has_checkpoint=(run_dir / CHECKPOINT_DIR).is_dir())  # a training run's folder


def train_reward_model_run(cfg: Any, run_dir: Path, quiet: bool = False) -> dict[str, Any]:
    """``rlfabric train-rm``: the reward-model stage of ``cfg`` alone, in ``run_dir`` (config snapshot,
    metrics.jsonl, TensorBoard, summary.json; the model in ``run_dir/reward_model``). Returns the summary. Bad
    input found on the way (a ConfigError) removes the folders it made, as a GRPO run's setup does."""
    from rlfabric.run.log import RunLog, write_summary
    from rlfabric.run.progress import PhaseProgressLine, tensorboard_view

    check_reward_model_run(cfg, run_dir)
    # the outermost folder this run creates, removed again if bad input stops it (pairs without their columns, ...)
    created = next((p for p in reversed([run_dir, *run_dir.parents]) if not p.exists()), None)
    log = RunLog(
        run_dir,
        cfg,
        quiet=quiet,
        step_key="rm_step",
        progress_line=PhaseProgressLine(cfg),
        tensorboard_view=tensorboard_view,
    )
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []  # the held-out rankings, for the summary

    def log_row(row: dict[str, Any]) -> None:
        log.log({"iteration": 0, **row})
        if row["phase"] == "rm_eval":
            rows.append(row)

    try:
        folder = ensure_reward_model(cfg, run_dir, policy_tokenizer(cfg), log_row)
    except ConfigError:
        log.close()
        if created is not None and not (run_dir / REWARD_MODEL_DIR / "config.json").is_file():
            shutil.rmtree(created, ignore_errors=True)
        raise
    except BaseException:
        log.close()
        raise
    log.close()
    summary = {
        "reward_model": str(folder),
        "heads": list(cfg.reward_model.heads),
        **{f"{k}_initial": v for k, v in rows[0].items() if k.startswith("rm_eval_accuracy")},
        **{f"{k}_final": v for k, v in rows[-1].items() if k.startswith("rm_eval_accuracy")},
        "time_total_s": round(time.perf_counter() - started, 1),
    }
    write_summary(run_dir, summary)
    return summary
