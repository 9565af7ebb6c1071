"""Shared fixtures: a local Ray instance for the tests that need actors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import ray

# Ray's logs from actor processes would interleave with pytest's output.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance with more logical CPUs than cores, so runners and learner all schedule."""
    if ray.is_initialized():
        ray.shutdown()
    # address="local": a new instance even when a cluster (`ray start`) runs on the machine
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def rm_example_run(tmp_path_factory) -> tuple[Path, dict]:
    """examples/rm_grpo.yaml, unchanged, run once a session: (its run folder, its summary). Its first stage trains
    the reward model from preference pairs (RUN/reward_model) that the reward-model tests also serve, so that
    model, two minutes of training, is trained once. It starts Ray for itself when none runs (a session fixture
    is set up before a module's ``local_ray``) and stops what it started."""
    import yaml

    from rlfabric.config import config_from_dict
    from rlfabric.llm_driver import train_llm

    example = Path(__file__).resolve().parent.parent / "examples" / "rm_grpo.yaml"
    run_dir = tmp_path_factory.mktemp("rm_example") / "run"
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        summary = train_llm(config_from_dict(yaml.safe_load(example.read_text())), run_dir, quiet=True)
    finally:
        if started:
            ray.shutdown()
    return run_dir, summary


def run_training(cfg, run_dir: Path) -> tuple[dict, list[dict]]:
    """Train to the end with a Trainer (actors always cleaned up); return (summary, metrics.jsonl rows)."""
    from rlfabric.driver import Trainer

    trainer = Trainer(cfg, run_dir, quiet=True)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


@pytest.fixture
def train():
    """``train(cfg, run_dir) -> (summary, rows)``."""
    return run_training
