"""Shared fixtures: a local Ray instance for the tests that need actors."""

from __future__ import annotations

import os

import pytest
import ray

# Ray's logs from actor processes would interleave with pytest's output.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance with more logical CPUs than cores, so runners and learner all schedule."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
