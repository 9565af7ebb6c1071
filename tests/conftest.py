"""Shared fixtures: a local Ray instance for the tests that need actors."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import ray

# Ray's logs from actor processes would interleave with pytest's output.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Two pytest-xdist workers share the cores, so an actor's OpenMP team that spin-waits between kernels waits on
# threads the other worker's processes hold: two GRPO runs at once took 7x as long each (430 s against 63 s alone)
# with the actors' bounded spin, 2x with sleeping threads. The actors and every run a test starts inherit this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# Modules that share one session fixture (``rm_example_run``: two minutes of training) run on one xdist worker.
SHARED_SCOPES = {"tests/test_reward_models.py": "tests/test_reward_model_grpo.py"}


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under ``pytest -n N`` (pytest-xdist), a module's tests run on one worker, in order, so its module fixtures
    (a Ray instance, a trained run) are made once; ``SHARED_SCOPES`` puts modules sharing a session fixture
    together."""
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:  # xdist's hook for what runs together
            scope = super()._split_scope(nodeid)
            return SHARED_SCOPES.get(scope, scope)

    return ModuleScheduling(config, log)


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


# -- a user's env module in the current directory (--import) ------------------------------------------------

ENV_MODULE = '''
import os
from pathlib import Path

import gymnasium as gym
import numpy as np

import rlfabric

MARKS = Path({marks!r})


class Corridor(gym.Env):
    """Walk right to the end; each process that builds one leaves a mark with its pid."""

    def __init__(self, length=4):
        MARKS.mkdir(exist_ok=True)
        (MARKS / str(os.getpid())).touch()
        self.length, self.pos = length, 0
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=(1,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = 0
        return np.array([0.0], np.float32), {{}}

    def step(self, action):
        self.pos = max(0, self.pos + (1 if action == 1 else -1))
        done = self.pos >= self.length
        return np.array([self.pos / self.length], np.float32), float(done) - 0.1, done, False, {{}}


rlfabric.register_env({name!r}, lambda **kw: Corridor(**kw))
'''


@pytest.fixture
def cwd_env_module(tmp_path, monkeypatch):
    """A module in a fresh current directory (not on sys.path) that registers an env; (module, env name, marks)."""
    from rlfabric import registry

    module = f"cwd_envs_{os.getpid()}_{time.monotonic_ns()}"
    name = f"corridor-{module}"
    marks = tmp_path / "marks"
    (tmp_path / f"{module}.py").write_text(ENV_MODULE.format(marks=str(marks), name=name))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # what --import adds is undone after the test
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    yield module, name, marks
    sys.modules.pop(module, None)
