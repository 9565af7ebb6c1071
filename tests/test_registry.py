"""The env registry: spec resolution and shipping registrations to processes that cannot import user code."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import pytest

import rlfabric
from rlfabric import registry
from rlfabric.registry import EnvNotFoundError

HELPERS = """
import gymnasium as gym
import numpy as np

class LineEnv(gym.Env):
    def __init__(self, length=3):
        self.length = length
        self.observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
"""

FACTORIES = """
from rl_helpers_mod import LineEnv

def make_line(length=3, scale=1):
    return LineEnv(length * scale)
"""


def test_snapshot_ships_user_modules_a_fresh_process_cannot_import(tmp_path, monkeypatch):
    """A factory in one user module, its env class in another, and a functools.partial of it all arrive."""
    (tmp_path / "rl_helpers_mod.py").write_text(HELPERS)
    (tmp_path / "rl_factories_mod.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    import rl_factories_mod

    rlfabric.register_env("line", rl_factories_mod.make_line)
    rlfabric.register_env("line-x2", functools.partial(rl_factories_mod.make_line, scale=2))
    blob = registry.snapshot()
    (tmp_path / "blob.bin").write_bytes(blob)
    check = textwrap.dedent(
        f"""
        import sys
        from rlfabric import registry
        assert not any("{tmp_path}" in p for p in sys.path)
        registry.load_snapshot(open("{tmp_path / "blob.bin"}", "rb").read())
        print(registry.make_env("line", {{"length": 4}}).length, registry.make_env("line-x2", {{}}).length)
        """
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd="/", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["4", "6"]


GYM_REGISTERING = """
import gymnasium as gym
import numpy as np

class PointReach(gym.Env):
    def __init__(self, size=1.0):
        self.size = size
        self.observation_space = gym.spaces.Box(-size, size, (2,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

gym.register(id="{env_id}", entry_point="rl_gym_reg_mod:PointReach", max_episode_steps=7, kwargs={{"size": 2.0}})
"""


def test_snapshot_ships_ids_a_user_module_registers_with_gymnasium(tmp_path, monkeypatch):
    """``gymnasium.register`` in a module a fresh process cannot import: ``gym:<id>`` builds there, with the
    registration's kwargs and time limit."""
    import gymnasium as gym

    env_id = f"PointReachGym{tmp_path.name.replace('_', '')}-v0"
    (tmp_path / "rl_gym_reg_mod.py").write_text(GYM_REGISTERING.format(env_id=env_id))
    monkeypatch.syspath_prepend(str(tmp_path))
    import rl_gym_reg_mod  # noqa: F401 - registers the id

    try:
        (tmp_path / "blob.bin").write_bytes(registry.snapshot())
    finally:
        gym.registry.pop(env_id, None)
        sys.modules.pop("rl_gym_reg_mod", None)
    check = textwrap.dedent(
        f"""
        from rlfabric import registry
        registry.load_snapshot(open("{tmp_path / "blob.bin"}", "rb").read())
        env = registry.make_env("gym:{env_id}")
        print(env.unwrapped.size, env.spec.max_episode_steps)
        """
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd="/", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2.0", "7"]


def test_import_error_inside_a_user_module_is_not_hidden(tmp_path, monkeypatch):
    (tmp_path / "rl_broken_mod.py").write_text("import rl_module_that_does_not_exist\n\ndef make():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="rl_module_that_does_not_exist"):
        registry.resolve("rl_broken_mod:make")
    # a module:factory spec says which part is missing: the module, or the factory in a module that exists
    with pytest.raises(EnvNotFoundError) as info:
        registry.resolve("rl_no_such_pkg.envs:make")
    assert str(info.value) == (
        "env.id = 'rl_no_such_pkg.envs:make' is not valid: no module 'rl_no_such_pkg.envs' in the current directory "
        "or on the Python path (nor a registered name; see `rlfabric envs list`)"
    )
    with pytest.raises(EnvNotFoundError, match="module 'rlfabric.envs.guess_number' has no function 'make_it'"):
        registry.resolve("rlfabric.envs.guess_number:make_it")


def test_a_misspelt_factory_and_a_file_path_for_a_module_get_the_spec_meant(tmp_path, monkeypatch):
    (tmp_path / "rl_user_envs.py").write_text("def make_env():\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvNotFoundError) as info:
        registry.resolve("rl_user_envs:make_envs")
    assert "module 'rl_user_envs' has no function 'make_envs' (did you mean 'make_env'?)" in str(info.value)
    with pytest.raises(EnvNotFoundError) as info:
        registry.resolve("rl_user_envs.py:make_env")
    assert "no module 'rl_user_envs.py': a module is named without '.py' or slashes ('rl_user_envs:make_env')" in str(
        info.value
    )


def test_specs_resolve_in_order():
    rlfabric.register_env("gym-alias", lambda: None)
    assert registry.resolve("gym-alias")() is None
    env = registry.make_env("gym:CartPole-v1", {"max_episode_steps": 7})
    assert env.spec.max_episode_steps == 7
    assert registry.resolve("rlfabric/PointMass-v0").__name__ == "PointMassEnv"  # entry point
    with pytest.raises(EnvNotFoundError, match="did you mean gym:CartPole-v1"):
        registry.resolve("gym:CartPole-v9")
    with pytest.raises(ValueError, match="must not start with 'gym:'|not starting with 'gym:'"):
        rlfabric.register_env("gym:Mine-v0", lambda: None)


def test_a_misspelt_registered_name_gets_a_suggestion(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", {})  # alone: other modules register names close to it
    rlfabric.register_env("point-reach", lambda: None)
    with pytest.raises(EnvNotFoundError, match=r"env.id = 'point-reech' is not valid: .*did you mean point-reach\?"):
        registry.resolve("point-reech")
