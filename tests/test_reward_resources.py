"""Reward workers on the resources they ask for: a share of a GPU (Ray hands it to them; a worker that asks for none
sees none) and a custom resource, on a Ray instance of its own that declares them."""

from __future__ import annotations

import pytest
import ray
from test_reward_service import group

from rlfabric.reward_pool import RewardPool

# Clusters of its own: it stops the shared local instance, so it runs after every module that uses it.
pytestmark = pytest.mark.own_ray


def test_reward_workers_get_the_gpus_and_resources_they_ask_for():
    """On a cluster that declares one GPU and two "rm" resources: workers asking for half a GPU each share it
    (Ray hands each the GPU), workers asking for none see none, and a custom resource places them."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, num_gpus=1, resources={"rm": 2}, include_dashboard=False, log_to_driver=False)
    try:
        on_gpu = RewardPool(["tagged"], 2, 5.0, 0.5, num_gpus_per_worker=0.5, resources={"rm": 1})
        plain = RewardPool(["tagged"], 1, 5.0, 0.5)
        try:
            shared = on_gpu.score([group("devices"), group("devices")])
            assert [r.components["gpus"] for g in shared for r in g] == [1.0] * 4
            assert [r.components["gpus"] for g in plain.score([group("devices")]) for r in g] == [0.0, 0.0]
            available = ray.available_resources()
            assert available.get("GPU", 0.0) == 0.0 and available.get("rm", 0.0) == 0.0  # both held
        finally:
            on_gpu.shutdown()
            plain.shutdown()
    finally:
        ray.shutdown()
