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
