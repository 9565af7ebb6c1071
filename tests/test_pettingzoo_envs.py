"""PettingZoo envs through the env registry (``pettingzoo:`` specs, ``package:module``, ``register_env``), PettingZoo's
own API tests on the envs rlfabric ships examples for, and ``rlfabric envs check`` on multi-agent envs."""

from __future__ import annotations

import sys
import textwrap
import warnings

import gymnasium as gym
import numpy as np
import pettingzoo
import pytest
from pettingzoo import AECEnv, ParallelEnv

with warnings.catch_warnings():  # pettingzoo.test imports an env module PettingZoo itself deprecates
    warnings.simplefilter("ignore", DeprecationWarning)
    from pettingzoo.test import api_test, parallel_api_test, parallel_seed_test, seed_test

from rlfabric import registry
from rlfabric.cli import main
from rlfabric.config import ConfigError
from rlfabric.registry import EnvNotFoundError, is_multi_agent, make_multi_agent_env, register_env


class Duel(ParallelEnv):
    """Two agents for three steps: 'a' picks one of 3 moves (Discrete), 'b' acts in ``b_action`` (MultiDiscrete by
    default, which rlfabric's policies cannot sample). ``infos_at_reset=False`` breaks the Parallel API."""

    metadata = {"name": "duel_v0", "render_modes": []}

    def __init__(self, b_action: gym.Space | None = None, infos_at_reset: bool = True) -> None:
        self.possible_agents = ["a", "b"]
        self.agents: list[str] = []
        self._obs = {agent: gym.spaces.Box(0.0, 3.0, (2,), np.float32) for agent in self.possible_agents}
        self._act = {"a": gym.spaces.Discrete(3), "b": b_action or gym.spaces.MultiDiscrete([3, 3])}
        self.infos_at_reset = infos_at_reset
        self.t = 0

    def observation_space(self, agent: str) -> gym.Space:
        return self._obs[agent]

    def action_space(self, agent: str) -> gym.Space:
        return self._act[agent]

    def _observe(self) -> dict[str, np.ndarray]:
        return {agent: np.array([self.t, 1.0], np.float32) for agent in self.agents}

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self.agents, self.t = list(self.possible_agents), 0
        return self._observe(), ({agent: {} for agent in self.agents} if self.infos_at_reset else {})

    def step(self, actions: dict) -> tuple[dict, dict, dict, dict, dict]:
        self.t += 1
        done = self.t >= 3
        out = (
            self._observe(),
            {agent: 0.0 for agent in self.agents},
            {agent: done for agent in self.agents},
            {agent: False for agent in self.agents},
            {agent: {} for agent in self.agents},
        )
        if done:
            self.agents = []
        return out


@pytest.fixture(autouse=True)
def own_registry(monkeypatch):
    """Registrations made by a test stay in that test."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


# -- spec forms ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["pettingzoo:classic.tictactoe_v3", "pettingzoo:classic/tictactoe-v3"])
def test_tictactoe_specs_make_the_aec_env_through_pettingzoos_registry(spec):
    env = make_multi_agent_env(spec)
    assert isinstance(env, AECEnv) and env.possible_agents == ["player_1", "player_2"]
    assert registry.resolve(spec).registry_id == "classic/tictactoe-v3"
    # the deprecated module (importing it warns) was never imported
    assert "pettingzoo.classic.tictactoe_v3" not in sys.modules
    assert is_multi_agent(spec)


def test_connect_four_is_aec_and_env_kwargs_pass_through():
    env = make_multi_agent_env("pettingzoo:classic.connect_four_v3", {"render_mode": "rgb_array"})
    assert isinstance(env, AECEnv) and env.possible_agents == ["player_0", "player_1"]
    assert env.unwrapped.render_mode == "rgb_array"


def test_parallel_is_made_where_the_registry_or_module_offers_it():
    env = make_multi_agent_env("mpe2:simple_spread_v3", {"N": 2})
    assert isinstance(env, ParallelEnv) and env.possible_agents == ["agent_0", "agent_1"]
    assert isinstance(make_multi_agent_env("pettingzoo:classic.rps_v2"), ParallelEnv)
    assert is_multi_agent("mpe2:simple_spread_v3")


def test_module_factory_specs_keep_meaning_the_callable():
    """``package.module:factory`` names a callable (here the AEC one), ``package:module`` an env module."""
    assert isinstance(make_multi_agent_env("mpe2.simple_spread_v3:env", {"N": 2}), AECEnv)
    assert isinstance(make_multi_agent_env("mpe2.simple_spread_v3:parallel_env", {"N": 2}), ParallelEnv)
    assert isinstance(make_multi_agent_env(f"{__name__}:Duel"), ParallelEnv)


GAME_MODULE = """
from pettingzoo.classic.rps import rps


class raw_env(rps.raw_env):
    metadata = {{**rps.raw_env.metadata, "is_parallelizable": {parallelizable}}}


def env(**kwargs):
    return rps.env(**kwargs)


def parallel_env(**kwargs):
    return rps.parallel_env(**kwargs)
"""


def test_package_module_of_a_users_package_is_parallel_unless_it_says_it_is_not(tmp_path, monkeypatch):
    package = tmp_path / "rl_pz_games"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "open_v0.py").write_text(textwrap.dedent(GAME_MODULE.format(parallelizable=True)))
    (package / "turns_v0.py").write_text(textwrap.dedent(GAME_MODULE.format(parallelizable=False)))
    (package / "helpers.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(make_multi_agent_env("rl_pz_games:open_v0"), ParallelEnv)
    assert isinstance(make_multi_agent_env("rl_pz_games:turns_v0"), AECEnv)
    with pytest.raises(EnvNotFoundError, match=r"module rl_pz_games.helpers has no parallel_env or env function"):
        registry.resolve("rl_pz_games:helpers")
    with pytest.raises(EnvNotFoundError, match=r"did you mean rl_pz_games:open_v0"):
        registry.resolve("rl_pz_games:opem_v0")


def make_spread(**kwargs):
    import mpe2.simple_spread_v3

    return mpe2.simple_spread_v3.parallel_env(**kwargs)


def test_register_env_factories_returning_parallel_and_aec_envs():
    register_env("spread-2", lambda **kw: make_spread(N=2, **kw))
    register_env("tictactoe", lambda: pettingzoo.make("aec", "classic/tictactoe-v3"))
    register_env("duel", Duel)
    assert isinstance(make_multi_agent_env("spread-2", {"max_cycles": 5}), ParallelEnv)
    assert isinstance(make_multi_agent_env("tictactoe"), AECEnv)
    assert all(is_multi_agent(name) for name in ("spread-2", "tictactoe", "duel"))
    with pytest.raises(TypeError, match=r"a PettingZoo env: it trains with a multi_agent config"):
        registry.make_env("tictactoe")
    with pytest.raises(TypeError, match=r"is a PettingZoo env: it trains with a multi_agent config"):
        registry.make_env("pettingzoo:classic.tictactoe_v3")


def test_gymnasium_specs_are_single_agent_and_not_built_to_tell(monkeypatch):
    built = []

    class Counted(gym.Env):
        observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def __init__(self) -> None:
            built.append(1)

    monkeypatch.setitem(
        gym.registry, "RlfabricCounted-v0", gym.envs.registration.EnvSpec("RlfabricCounted-v0", Counted)
    )
    assert not is_multi_agent("gym:RlfabricCounted-v0")
    assert built == []
    register_env("counted", Counted)
    register_env("counted-fn", lambda: Counted())
    assert not is_multi_agent("counted") and built == []  # an env class says what it is
    assert not is_multi_agent("counted-fn") and built == [1]  # a function is built once to find out
    with pytest.raises(ConfigError, match=r"env.id = 'gym:CartPole-v1' is not valid for a multi_agent config"):
        make_multi_agent_env("gym:CartPole-v1")
    with pytest.raises(EnvNotFoundError, match="rl_no_such_games"):
        is_multi_agent("rl_no_such_games:duel_v0")


@pytest.mark.parametrize(
    ("spec", "close"),
    [
        ("pettingzoo:classic.tictactoe_v9", "pettingzoo:classic.tictactoe_v3"),
        ("pettingzoo:classic/tictactoo-v3", "pettingzoo:classic/tictactoe-v3"),
        ("pettingzoo:classic.connect4_v3", "pettingzoo:classic.connect_four_v3"),
    ],
)
def test_a_pettingzoo_spec_that_names_nothing_is_one_line_with_close_matches(spec, close):
    with pytest.raises(EnvNotFoundError) as info:
        registry.resolve(spec)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"env.id = {spec!r} is not valid")
    assert f"did you mean {close}" in message


def test_pettingzoos_old_mpe_family_points_to_mpe2():
    with pytest.raises(EnvNotFoundError, match=r"moved to the mpe2 package: use mpe2:simple_spread_v3"):
        registry.resolve("pettingzoo:mpe.simple_spread_v3")


# -- PettingZoo's own tests on the envs rlfabric ships examples for --------------------------------------------------


@pytest.mark.filterwarnings("ignore:Observation numpy array is all zeros")  # the empty board, as PettingZoo says
@pytest.mark.parametrize("spec", ["pettingzoo:classic.tictactoe_v3", "pettingzoo:classic.connect_four_v3"])
def test_pettingzoo_api_and_seed_tests_pass_on_the_shipped_aec_games(spec):
    api_test(make_multi_agent_env(spec), num_cycles=200)
    seed_test(lambda: make_multi_agent_env(spec), num_cycles=200)


def test_pettingzoo_parallel_api_and_seed_tests_pass_on_simple_spread():
    parallel_api_test(make_multi_agent_env("mpe2:simple_spread_v3"), num_cycles=200)
    parallel_seed_test(lambda: make_multi_agent_env("mpe2:simple_spread_v3"), num_cycles=200)


# -- rlfabric envs check / list ------------------------------------------------------------------------------------


def test_envs_check_tictactoe_finds_the_mask_and_flattens_the_board(capsys):
    assert main(["envs", "check", "pettingzoo:classic.tictactoe_v3", "--cycles", "50"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "pettingzoo:classic.tictactoe_v3: PettingZoo AEC env tictactoe_v3, 2 agents"
    assert "PASS api_test (50 cycles)" in lines and "PASS seed_test (50 cycles)" in lines
    group = next(i for i, line in enumerate(lines) if line.startswith("agents player_1, player_2: observation Dict("))
    assert lines[group + 1] == "  action mask found under 'action_mask': masked actions get zero probability"
    assert lines[group + 2] == "  observation Box(0, 1, (3, 3, 2), int8) flattened to 18 values"
    assert lines[group + 3] == "  discrete actions: categorical policy over 9 actions"
    assert "global state: none (state() is not implemented)" in lines
    assert lines[-1] == "OK pettingzoo:classic.tictactoe_v3"


def test_envs_check_simple_spread_reports_its_global_state(capsys):
    assert main(["envs", "check", "mpe2:simple_spread_v3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "mpe2:simple_spread_v3: PettingZoo Parallel env simple_spread_v3, 3 agents"
    assert "PASS parallel_api_test (100 cycles)" in lines
    assert "agents agent_0, agent_1, agent_2: observation Box(-inf, inf, (18,), float32), action Discrete(5)" in lines
    state = next(line for line in lines if line.startswith("global state:"))
    assert state.startswith("global state: state() gives 54 values from state_space Box(-inf, inf, (54,), float32)")
    assert lines[-1] == "OK mpe2:simple_spread_v3"


def test_envs_check_says_why_an_agents_space_is_refused(capsys):
    register_env("duel", Duel)
    assert main(["envs", "check", "duel"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "PASS parallel_api_test (100 cycles)" in lines  # a valid PettingZoo env ...
    a = lines.index("agent a: observation Box(0.0, 3.0, (2,), float32), action Discrete(3)")
    assert lines[a + 1] == "  discrete actions: categorical policy over 3 actions"
    b = lines.index("agent b: observation Box(0.0, 3.0, (2,), float32), action MultiDiscrete([3 3])")
    assert lines[b + 1] == (
        "  refused: agent 'b': action space MultiDiscrete([3 3]) is not supported: use Discrete or a 1-d Box "
        "(flatten others with a gymnasium wrapper in the env factory)"
    )
    assert lines[-1] == "FAIL duel: the spaces of b are refused"  # ... rlfabric cannot train


def test_envs_check_reports_a_failed_api_test_in_one_line(capsys):
    register_env("duel-broken", lambda: Duel(gym.spaces.Discrete(3), infos_at_reset=False))
    assert main(["envs", "check", "duel-broken"]) == 1
    lines = capsys.readouterr().out.splitlines()
    failed = next(line for line in lines if line.startswith("FAIL parallel_api_test"))
    assert failed.startswith("FAIL parallel_api_test (100 cycles): AssertionError: at parallel_test.py:")
    assert "infos.keys()" in failed
    assert "agents a, b: observation Box(0.0, 3.0, (2,), float32), action Discrete(3)" in lines  # one group
    assert lines[-1].startswith("FAIL duel-broken: parallel_api_test")


def test_envs_check_bad_pettingzoo_name_is_one_config_error(capsys):
    assert main(["envs", "check", "pettingzoo:classic.tictactoe_v9"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "did you mean pettingzoo:classic.tictactoe_v3?" in captured.err


def test_envs_list_names_the_pettingzoo_spec_form(capsys):
    assert main(["envs", "list"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("PettingZoo envs"))
    assert "pettingzoo:<family>.<name>" in line and "mpe2:simple_spread_v3" in line
    assert "classic/chess" not in out  # the registry is not enumerated
