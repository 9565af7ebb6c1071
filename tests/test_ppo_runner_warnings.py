"""A PPO runner shows each distinct MuJoCo warning once, not once per env it builds."""

from __future__ import annotations

import warnings

import gymnasium as gym
import pytest

from rlfabric.actors.env_runner import MujocoWarning, show_mujoco_warnings_once


def test_mujoco_warnings_are_shown_once_however_many_envs_are_built():
    """MuJoCo's C library prints a model file's deprecation itself, once per env built (HalfCheetah-v5's
    "compiler attribute 'settotalmass' is deprecated"); a runner routes it through Python's warnings, once."""
    mujoco = pytest.importorskip("mujoco")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.onceregistry.clear()  # shown once per process: forget an earlier test's
            show_mujoco_warnings_once()
            for _ in range(3):
                gym.make("HalfCheetah-v5").close()
    finally:
        mujoco.set_mju_user_warning(None)  # MuJoCo's own printing again, for the tests after this one
    texts = [str(w.message) for w in caught if issubclass(w.category, MujocoWarning)]
    assert len(texts) == 1, texts
    assert "compiler attribute 'settotalmass' is deprecated" in texts[0]
