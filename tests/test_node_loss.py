"""A node lost mid-run on a multi-node cluster (``ray.cluster_utils.Cluster``: a head and worker nodes, each its
own raylet): its actors are replaced on a node that joins, the trajectories it took with it are collected again,
nothing is trained twice; with no node left that has what a replacement asks for, the run stops with one line
naming it and a checkpoint.

The learner is pinned to the head (a learner lost with its node ends a run). To lose trajectories the driver
already accepted, the learner is held (a call that waits for a file) while the rollout side runs ahead; the node
is removed once the run's counters show that state, then the learner is let go: no step depends on timing.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import ray
from grpo_runs import BASE, merged
from ray.cluster_utils import Cluster

import rlfabric
from rlfabric.actor_slots import PlacementError
from rlfabric.config import config_from_dict, ppo_config_from_dict
from rlfabric.driver import Trainer, latest_checkpoint
from rlfabric.llm_driver import GRPOTrainer
from rlfabric.llm_run_state import latest_checkpoint as latest_grpo_checkpoint
from rlfabric.run.log import read_metrics

# Clusters of its own: it stops the shared local instance, so it runs after every module that uses it.
pytestmark = pytest.mark.own_ray

WIDE = 512  # observation floats: a 64-step fragment of 2 envs is ~260 KB, kept in its runner node's object store


class WideCorridor(gym.Env):
    """Walk right to the end of a corridor; the position is the first of ``WIDE`` observation floats."""

    def __init__(self, length: int = 6) -> None:
        self.length = length
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=(WIDE,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.pos = 0

    def _obs(self) -> np.ndarray:
        obs = np.zeros(WIDE, np.float32)
        obs[0] = self.pos / self.length
        return obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = 0
        return self._obs(), {}

    def step(self, action):
        self.pos = max(0, self.pos + (1 if action == 1 else -1))
        done = self.pos >= self.length
        return self._obs(), (1.0 if done else -0.1), done, False, {}


@pytest.fixture
def cluster():
    """A head (1 CPU and the "learner" resource) and nothing else yet; the tests add and remove worker nodes.
    Records bigger than 1500 bytes go to the object store of the node that made them (Ray keeps smaller objects
    in the owner's memory, where a node's death cannot take them; real runs' records are megabytes)."""
    if ray.is_initialized():
        ray.shutdown()
    head = {"num_cpus": 1, "resources": {"learner": 1}, "include_dashboard": False}
    cluster = Cluster(
        initialize_head=True, head_node_args={**head, "_system_config": {"max_direct_call_object_size": 1500}}
    )
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def in_thread(train) -> tuple[threading.Thread, dict]:
    """``train()`` on a started thread; the dict gets its "summary" or its "error"."""
    out: dict = {}

    def run() -> None:
        try:
            out["summary"] = train()
        except BaseException as exc:  # handed to the test, which asserts on it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def wait_for(condition, thread: threading.Thread) -> None:
    """Until ``condition()`` holds (the run's counters); fails if the run ended first."""
    while not condition():
        assert thread.is_alive(), "the run ended before the state the test waits for"
        time.sleep(0.02)


def hold(actor, release: Path) -> None:
    """Queue a call on ``actor`` that returns once ``release`` exists: calls behind it wait (a held learner)."""

    def wait_for_file(_self, path: str) -> None:
        while not os.path.exists(path):
            time.sleep(0.02)

    actor.__ray_call__.remote(wait_for_file, str(release))


PPO = {
    "env": {"id": "wide_corridor", "kwargs": {"length": 6}},
    "runners": {"num_runners": 2, "envs_per_runner": 2, "num_cpus": 0.5, "resources": {"rollout": 1}},
    "learner": {"num_cpus": 0.5, "resources": {"learner": 1}},
    "ppo": {"train_batch_size": 256, "minibatch_size": 128, "num_epochs": 2},
    "training": {"total_env_steps": 1024, "eval_episodes": 0, "max_policy_lag": 1, "checkpoint_every": 2},
}


def ppo_trainer(run_dir: Path, **changes) -> Trainer:
    rlfabric.register_env("wide_corridor", lambda **kw: WideCorridor(**kw))
    return Trainer(ppo_config_from_dict(merged(PPO, changes)), run_dir, quiet=True)


def test_ppo_runner_node_lost_mid_run(cluster, tmp_path):
    lost = cluster.add_node(num_cpus=2, resources={"rollout": 2})
    trainer = ppo_trainer(tmp_path / "run", runners={"sample_timeout_s": 60.0})
    release = tmp_path / "release"
    try:
        trainer.setup()
        hold(trainer.learner, release)
        thread, out = in_thread(trainer.train)
        # The learner is held before its first update: the driver accepts a batch for it and a second one behind
        # it (max_policy_lag 1), 4 fragments in the lost node's object store, and its runners go idle.
        wait_for(lambda: trainer.progress.env_steps_sampled >= 2 * 256, thread)
        cluster.remove_node(lost)
        spare = cluster.add_node(num_cpus=2, resources={"rollout": 2})
        release.touch()
        thread.join(timeout=120)
        assert not thread.is_alive()
        runner_nodes = {trainer.pool.call(i, "node_id", timeout=30) for i in range(2)}
    finally:
        trainer.close()
    assert "error" not in out, out.get("error")
    summary, rows = out["summary"], read_metrics(tmp_path / "run")
    # 4 accepted fragments lost with the node, each dropped and sampled again, plus the one sample each dead
    # runner was asked for before it was replaced
    assert summary["lost_fragments"] == 6 and summary["runner_restarts"] == 2
    assert runner_nodes == {spare.node_id}
    # every update trained one full batch of fresh fragments: none twice, none lost
    assert [r["env_steps"] for r in rows] == [256, 512, 768, 1024]
    assert summary["env_steps"] == 1024


def error_once_node_lost(cluster, lost, trainer, trained_some) -> BaseException | None:
    """Train in a thread, remove ``lost`` once ``trained_some()``, and return what the run raised (it must end)."""
    try:
        trainer.setup()
        thread, out = in_thread(trainer.train)
        wait_for(trained_some, thread)
        cluster.remove_node(lost)
        thread.join(timeout=120)
        assert not thread.is_alive()
    finally:
        trainer.close()
    return out.get("error")


def test_ppo_with_no_node_for_a_runner_stops_with_what_it_asked_for(cluster, tmp_path):
    lost = cluster.add_node(num_cpus=2, resources={"rollout": 2})
    trainer = ppo_trainer(tmp_path / "run", runners={"sample_timeout_s": 5.0})
    error = error_once_node_lost(cluster, lost, trainer, lambda: trainer.progress.iteration >= 1)
    assert isinstance(error, PlacementError), error
    message = str(error)
    assert "\n" not in message and "no alive node has CPU=0.5, rollout=1" in message, message
    assert message.startswith("runner ") and "waited 5s" in message
    done = trainer.progress.iteration
    assert latest_checkpoint(tmp_path / "run").name == f"iter_{done:06d}.pt"  # what was trained is kept
    assert len(read_metrics(tmp_path / "run")) == done


GRPO = {
    "generator": {"resources": {"gen": 1}, "timeout_s": 60},
    "learner": {"resources": {"learner": 1}},
    "training": {"total_steps": 4, "max_policy_lag": 1, "checkpoint_every": 2},
}


def place_rollout_worker_on(trainer: GRPOTrainer, node_id: str) -> None:
    """Ray puts an actor that asks for nothing (the rollout worker) on a random node: start it again until it
    runs on ``node_id`` (half the nodes here: a few tries)."""
    slots = trainer.rollout_workers
    for _ in range(50):
        if ray.get(slots.handles[0].node_id.remote(), timeout=60) == node_id:
            return
        slots.replace(0, slots.generations[0], "placed by the test", failure=False)
    raise AssertionError("the rollout worker never started on the node the test removes")


def test_grpo_generator_and_rollout_worker_node_lost_mid_run(cluster, tmp_path):
    lost = cluster.add_node(num_cpus=2, resources={"gen": 2})
    trainer = GRPOTrainer(config_from_dict(merged(BASE, GRPO)), tmp_path / "run", quiet=True)
    release = tmp_path / "release"
    try:
        trainer.setup()
        place_rollout_worker_on(trainer, lost.node_id)
        hold(trainer.learners[0], release)
        thread, out = in_thread(trainer.train)

        def first_rollout_accepted_and_second_one_done() -> bool:
            ahead = list(trainer.rollouts.in_flight)
            return (
                trainer.counters.samples >= 8 and len(ahead) == 1 and bool(ray.wait([ahead[0].meta_ref], timeout=0)[0])
            )

        # Step 1's record is accepted and its update waits on the held learner; step 2's rollout is done: both
        # records are in the lost node's object store, their metadata with the driver.
        wait_for(first_rollout_accepted_and_second_one_done, thread)
        cluster.remove_node(lost)  # the generator, the rollout worker and its reward services
        cluster.add_node(num_cpus=2, resources={"gen": 2})
        release.touch()
        thread.join(timeout=120)
        assert not thread.is_alive()
    finally:
        trainer.close()
    assert "error" not in out, out.get("error")
    summary = out["summary"]
    steps = [r for r in read_metrics(tmp_path / "run") if r.get("phase") == "grpo"]
    batch = 2 * 4  # prompts_per_step x group_size
    assert [r["trained_samples"] for r in steps] == [batch] * 4  # full batches, each sample once
    assert summary["samples"] == 4 * batch and summary["failed_samples"] == 0
    assert summary["generator_restarts"] == 1 and summary["rollout_worker_restarts"] == 1
    # asked again: the two lost records, and step 1's retry, which first went to the dead rollout worker
    assert summary["resampled_samples"] == 3 * batch


def test_grpo_with_no_node_for_a_generator_stops_with_what_it_asked_for(cluster, tmp_path):
    lost = cluster.add_node(num_cpus=2, resources={"gen": 2})
    changes = merged(GRPO, {"generator": {"timeout_s": 10}})
    trainer = GRPOTrainer(config_from_dict(merged(BASE, changes)), tmp_path / "run", quiet=True)
    error = error_once_node_lost(cluster, lost, trainer, lambda: trainer.counters.step >= 1)
    assert isinstance(error, PlacementError), error
    message = str(error)
    assert "\n" not in message and "generator 0 cannot be replaced: no alive node has CPU=0.5, gen=1" in message
    done = trainer.counters.step
    assert latest_grpo_checkpoint(tmp_path / "run").name == f"step_{done:06d}"  # what was trained is kept
    assert len([r for r in read_metrics(tmp_path / "run") if r.get("phase") == "grpo"]) == done
