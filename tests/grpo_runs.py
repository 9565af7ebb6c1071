"""Small GRPO runs for the pipeline and fault tests: a tiny builtin model, every setting spelled out."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from rlfabric.config import ConfigError, config_from_dict, load_config
from rlfabric.llm_driver import GRPOTrainer, train_llm

TINY = {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "max_positions": 64}

# Everything the checks rely on is set here, not left to defaults that may change.
BASE: dict = {
    "model": {"path": "builtin", "builtin": TINY},
    "data": {"train": "task:arithmetic?max_operand=9&ops=+", "eval": "", "num_train": 64, "num_eval": 8},
    "sampling": {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 0},
    "generator": {"backend": "torch", "num_generators": 1, "num_cpus": 0.5, "timeout_s": 120},
    "learner": {"num_learners": 1, "num_cpus": 0.5},
    # no weights: correct counts 1, format 0 by the arithmetic reward's own default (a test relies on it)
    "rewards": {"functions": [{"name": "arithmetic"}], "weights": {}, "num_cpus": 0.25},
    "grpo": {
        "prompts_per_step": 2,
        "group_size": 4,
        "advantage": "grpo",
        "loss_aggregation": "token_mean",
        "epochs": 1,
        "micro_batch_size": 8,
        "lr": 5e-4,
        "lr_schedule": "constant",
        "kl_coef": 0.0,
        "dynamic_sampling": False,
        "overlong_filter": False,
    },
    "sft": {"steps": 0, "batch_size": 16, "answer_key": "answer"},
    "training": {
        "total_steps": 3,
        "max_policy_lag": 0,
        "seed": 0,
        "eval_every": 0,
        "checkpoint_every": 0,
        "keep_checkpoints": 2,
        "show_samples": 8,
    },
}


def merged(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


@dataclasses.dataclass
class Run:
    run_dir: Path
    summary: dict
    rows: list[dict]
    console: str = ""  # what the run printed (its progress lines and notes), when it was not quiet

    def phase(self, name: str) -> list[dict]:
        return [r for r in self.rows if r.get("phase") == name]


def run_grpo(run_dir: Path, quiet: bool = True, **sections: dict) -> Run:
    """BASE with ``sections`` merged in, trained in ``run_dir``; not ``quiet``: what it prints is kept."""
    cfg = config_from_dict(merged(BASE, sections))
    console = io.StringIO()
    with contextlib.redirect_stderr(console) if not quiet else contextlib.nullcontext():
        summary = train_llm(cfg, run_dir, quiet=quiet)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return Run(run_dir, summary, rows, console.getvalue())


def write_prompts(path: Path, prompts: list[str]) -> str:
    """A .jsonl prompt file of "a+b=" rows with their answers."""
    rows = [{"prompt": p, "answer": str(sum(int(x) for x in p[:-1].split("+")))} for p in prompts]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def example_stopped_by_config_error(example: str, overrides: list[str], cwd: Path) -> tuple[list[str], str]:
    """``rlfabric train examples/<example> <overrides>`` in a fresh process on a local Ray instance, expected to stop
    with exit 2: (its ``rlfabric: config error:`` lines, its whole stderr)."""
    path = Path(__file__).resolve().parent.parent / "examples" / example
    done = subprocess.run(
        [sys.executable, "-m", "rlfabric.cli", "train", str(path), *overrides, "--run-dir", str(cwd / "run")],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("rlfabric: config error:")]
    return errors, done.stderr


def setup_error(tmp_path: Path, cfg_path: Path) -> str:
    """The one-line ConfigError the run's setup stops with, checked to come before Ray and to leave no run folder."""
    if ray.is_initialized():
        ray.shutdown()
    run_dir = tmp_path / "runs" / "run"
    trainer = GRPOTrainer(load_config(cfg_path), run_dir, quiet=True)
    try:
        with pytest.raises(ConfigError) as info:
            trainer.setup()
        assert not ray.is_initialized()
        assert not (tmp_path / "runs").exists()
        assert trainer.generators is None
    finally:
        trainer.close()
    message = str(info.value)
    assert "\n" not in message
    return message
