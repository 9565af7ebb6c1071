"""Placement per role (``ray.placement``) on a three-node cluster: a role's placement group puts its actors where
its strategy says, the run writes where each actor went (``placement.json``, and a line per role), and a group the
cluster cannot place is one line naming the role before any actor starts."""

from __future__ import annotations

import json

import pytest
import ray
from grpo_runs import BASE, merged
from ray.cluster_utils import Cluster

from rlfabric.config import ConfigError, config_from_dict, ppo_config_from_dict
from rlfabric.driver import Trainer
from rlfabric.llm_driver import GRPOTrainer

# Clusters of its own: it stops the shared local instance, so it runs after every module that uses it.
pytestmark = pytest.mark.own_ray


@pytest.fixture(scope="module")
def three_nodes():
    """A head with 1 CPU and two worker nodes with 2 CPUs each."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


def plan(run_dir) -> dict:
    return json.loads((run_dir / "placement.json").read_text())


def test_ppo_runners_spread_over_the_nodes_and_the_plan_says_where(three_nodes, tmp_path):
    cluster, workers = three_nodes
    cfg = ppo_config_from_dict(
        {
            "env": {"id": "gym:CartPole-v1"},
            "runners": {"num_runners": 2, "envs_per_runner": 2, "num_cpus": 1},
            "learner": {"num_cpus": 1},
            "ppo": {"train_batch_size": 128, "minibatch_size": 64, "num_epochs": 1},
            "training": {"total_env_steps": 256, "eval_episodes": 0},
            "ray": {"placement": {"runners": "STRICT_SPREAD"}},
        }
    )
    trainer = Trainer(cfg, tmp_path, quiet=True)
    try:
        trainer.setup()
        trainer.train()
    finally:
        trainer.close()
    where = plan(tmp_path)
    runner_nodes = [node.split("/")[1] for node in where["runners"]["nodes"]]
    assert where["runners"]["strategy"] == "STRICT_SPREAD" and len(runner_nodes) == 2
    assert len(set(runner_nodes)) == 2  # one runner on each of two nodes
    assert where["learner"]["strategy"] is None and len(where["learner"]["nodes"]) == 1
    all_nodes = {n.node_id[:8] for n in [cluster.head_node, *workers]}
    assert set(runner_nodes) <= all_nodes


def test_grpo_generators_and_reward_workers_spread_and_learner_packed(three_nodes, tmp_path):
    # 3 of the cluster's 5 CPUs, in amounts that fit whichever nodes Ray gives each group first
    placement = {"generator": "STRICT_SPREAD", "learner": "STRICT_PACK", "rewards": "STRICT_SPREAD"}
    cfg = config_from_dict(
        merged(
            BASE,
            {
                "generator": {"num_generators": 2, "num_cpus": 1},
                "learner": {"num_cpus": 0.5},
                "rewards": {"num_workers": 2, "num_cpus": 0.25},
                "training": {"total_steps": 1},
                "ray": {"placement": placement},
            },
        )
    )
    trainer = GRPOTrainer(cfg, tmp_path / "run", quiet=True)
    try:
        trainer.setup()
        trainer.train()
    finally:
        trainer.close()
    where = plan(tmp_path / "run")
    generator_nodes = {node.split("/")[1] for node in where["generator"]["nodes"]}
    assert len(generator_nodes) == 2 and where["generator"]["strategy"] == "STRICT_SPREAD"
    assert where["learner"]["strategy"] == "STRICT_PACK" and len(where["learner"]["nodes"]) == 1
    # the rollout worker starts the reward workers in the rewards group's bundles: one per node
    reward_nodes = {node.split("/")[1] for node in where["rewards"]["nodes"]}
    assert len(reward_nodes) == 2 and where["rewards"]["strategy"] == "STRICT_SPREAD"


def test_a_role_group_the_cluster_cannot_place_is_one_line_before_any_actor_starts(three_nodes, tmp_path):
    """Four runners, each on a node of its own, on a cluster of three nodes: said before any actor starts."""
    cfg = ppo_config_from_dict(
        {
            "runners": {"num_runners": 4, "envs_per_runner": 1, "num_cpus": 1},
            "ppo": {"train_batch_size": 128, "minibatch_size": 64},
            "ray": {"placement": {"runners": "STRICT_SPREAD"}},
        }
    )
    trainer = Trainer(cfg, tmp_path, quiet=True)
    try:
        with pytest.raises(
            ConfigError, match=r"ray.placement.runners = 'STRICT_SPREAD': the cluster could not place 4"
        ):
            trainer.setup()
        assert trainer.pool is None  # no runner started
    finally:
        trainer.close()
    assert not [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]


def test_a_local_instance_too_small_for_the_run_is_one_line_before_ray_starts(no_ray, tmp_path):
    """``ray.num_cpus`` fixes the local instance the run starts: the actors' CPUs are checked against it before
    Ray starts (it used to take Ray's start-up, about 20 s here, to find out)."""
    cfg = config_from_dict(merged(BASE, {"ray": {"num_cpus": 1}}))
    trainer = GRPOTrainer(cfg, tmp_path / "run", quiet=True)
    with pytest.raises(ConfigError, match=r"but the local Ray instance of ray\.num_cpus = 1 has CPU=1: raise ray"):
        trainer.setup()
    assert not ray.is_initialized()
