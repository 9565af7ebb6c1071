"""Across Ray nodes: a registration made in the driver's process reaches runners on another node, and a
supervised MCP tool server placed on another node serves episodes from this one over the node's address."""

from __future__ import annotations

import asyncio
import time

import gymnasium as gym
import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

import rlfabric
from rlfabric.actors.tool_server import ToolServer
from rlfabric.config import ppo_config_from_dict as config_from_dict
from rlfabric.driver import Trainer
from rlfabric.envs.task_library import TASK_SERVERS
from rlfabric.mcp_tools import McpSession

# Clusters of its own: it stops the shared local instance, so it runs after every module that uses it.
pytestmark = pytest.mark.own_ray


class CorridorEnv(gym.Env):
    """Defined only in this test file: walk right to the end of a corridor. Workers cannot import it."""

    def __init__(self, length: int = 6) -> None:
        self.length = length
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=(1,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.pos = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = 0
        return np.array([0.0], np.float32), {}

    def step(self, action):
        self.pos = max(0, self.pos + (1 if action == 1 else -1))
        done = self.pos >= self.length
        return np.array([self.pos / self.length], np.float32), (1.0 if done else -0.1), done, False, {}


@pytest.fixture
def two_node_cluster():
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    worker = cluster.add_node(num_cpus=2, resources={"rollout": 2})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster, worker
    ray.shutdown()
    cluster.shutdown()


def test_registered_env_runs_on_a_second_node(two_node_cluster, tmp_path):
    cluster, worker = two_node_cluster
    rlfabric.register_env("corridor", lambda **kw: CorridorEnv(**kw))
    cfg = config_from_dict(
        {
            "env": {"id": "corridor", "kwargs": {"length": 6}},
            "runners": {"num_runners": 2, "envs_per_runner": 2, "num_cpus": 0.5, "resources": {"rollout": 1}},
            "learner": {"num_cpus": 0.5},
            "ppo": {"train_batch_size": 256, "minibatch_size": 64, "num_epochs": 4},
            "training": {"total_env_steps": 5_000, "eval_episodes": 3},
        }
    )
    trainer = Trainer(cfg, tmp_path, quiet=True)
    try:
        trainer.setup()
        runner_nodes = {trainer.pool.call(i, "node_id") for i in range(2)}
        summary = trainer.train()
    finally:
        trainer.close()
    assert runner_nodes == {worker.node_id}
    assert worker.node_id != cluster.head_node.node_id
    assert summary["env_steps"] >= 5_000 and summary["episodes"] > 0
    assert summary["eval_return_mean"] == pytest.approx(1.0 - 0.1 * 5)  # learned to walk straight right


def test_a_tool_server_on_another_node_serves_sessions_from_this_one(two_node_cluster):
    # "rollout" is a resource only the second node has: the server's actor and process run there
    server = ToolServer.options(resources={"rollout": 1}).remote("notes", TASK_SERVERS["notes"].http_command)
    try:
        url = ray.get(server.start.remote(), timeout=60)
        health = ray.get(server.health.remote(), timeout=30)
        assert not url.startswith("http://127.0.0.1")  # the node's address: reachable from the other node

        async def write_then_read() -> tuple[list[str], str]:
            session = await McpSession.open(url)
            try:
                await session.call("put", {"key": "owl", "value": "mint"})
                return [t.name for t in session.tools()], await session.call("get", {"key": "owl"})
            finally:
                await session.close()

        tools, value = asyncio.run(write_then_read())
        assert {"put", "get", "delete", "keys"} <= set(tools) and value == "mint"
        assert health["alive"] and health["url"] == url
    finally:
        ray.get(server.stop.remote(), timeout=30)
        ray.kill(server)


def test_a_tool_server_whose_node_is_lost_is_started_again_on_another(two_node_cluster):
    """Ray restarts the server's actor (max_restarts) on the node left with the resource it asks for; the restarted
    actor starts its server there, and address() gives episodes the new URL."""
    cluster, _ = two_node_cluster
    first = cluster.add_node(num_cpus=1, resources={"tools": 1})
    server = ToolServer.options(resources={"tools": 1}).remote("notes", TASK_SERVERS["notes"].http_command)
    try:
        ray.get(server.start.remote(), timeout=60)
        old_pid = ray.get(server.health.remote(), timeout=30)["pid"]
        cluster.add_node(num_cpus=1, resources={"tools": 1})
        cluster.remove_node(first)
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            try:  # while Ray restarts the actor, calls fail with ActorUnavailableError (an episode's would fail)
                url, _ = ray.get(server.address.remote(), timeout=120)
            except ray.exceptions.ActorUnavailableError:
                time.sleep(0.5)
        assert url is not None and ray.get(server.health.remote(), timeout=30)["pid"] != old_pid

        async def write_then_read() -> str:
            session = await McpSession.open(url)
            try:
                await session.call("put", {"key": "owl", "value": "mint"})
                return await session.call("get", {"key": "owl"})
            finally:
                await session.close()

        assert asyncio.run(write_then_read()) == "mint"
    finally:
        ray.get(server.stop.remote(), timeout=30)
        ray.kill(server)
