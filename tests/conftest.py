"""Shared fixtures: a local Ray instance for the tests that need actors."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import ray

# Ray's logs from actor processes would interleave with pytest's output.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules marked ``own_ray`` start Ray clusters of their own, stopping the shared local instance: they run
    last (in their usual order), so the shared instance starts once rather than again after each of them."""
    items.sort(key=lambda item: item.get_closest_marker("own_ray") is not None)


_LOCAL_RAY = {"address": "local", "num_cpus": 4, "include_dashboard": False, "log_to_driver": False}
_shared_gcs: str | None = None  # the GCS address of the instance this session started last


def start_shared_ray() -> None:
    """Start the local Ray instance the tests share (more logical CPUs than cores, so runners and learner all
    schedule), unless it already runs. Starting one costs about 5.5 s with its stop, so modules share it; a module
    that needs a cluster of its own stops it first, and the next module that asks starts it again."""
    global _shared_gcs
    if ray.is_initialized():
        if ray.get_runtime_context().gcs_address == _shared_gcs:
            return
        ray.shutdown()
    # address="local": a new instance even when a cluster (`ray start`) runs on the machine
    ray.init(**_LOCAL_RAY)
    _shared_gcs = ray.get_runtime_context().gcs_address


def left_clean(wait_s: float = 10.0) -> bool:
    """Whether the shared instance is as a module found it: every CPU free and no named actor (an actor being
    killed frees its CPU within moments, so this waits up to ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        free = ray.available_resources().get("CPU", 0.0) >= ray.cluster_resources().get("CPU", 0.0)
        if free and not ray.util.list_named_actors(all_namespaces=True):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.fixture(scope="module")
def local_ray():
    """The shared local Ray instance; stopped after a module that left actors behind, so none leak into the next."""
    start_shared_ray()
    yield
    if ray.is_initialized() and not left_clean():
        ray.shutdown()


@pytest.fixture
def no_ray():
    """No Ray connection in this process, for a test that checks that a call did not start Ray."""
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def rm_example_run(tmp_path_factory) -> tuple[Path, dict]:
    """examples/rm_grpo.yaml, unchanged, run once a session: (its run folder, its summary). Its first stage trains
    the reward model from preference pairs (RUN/reward_model) that the reward-model tests also serve, so that
    model, two minutes of training, is trained once. It runs on the shared local Ray instance."""
    import yaml

    from rlfabric.config import config_from_dict
    from rlfabric.llm_driver import train_llm

    example = Path(__file__).resolve().parent.parent / "examples" / "rm_grpo.yaml"
    run_dir = tmp_path_factory.mktemp("rm_example") / "run"
    start_shared_ray()
    summary = train_llm(config_from_dict(yaml.safe_load(example.read_text())), run_dir, quiet=True)
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
