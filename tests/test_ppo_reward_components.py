"""Named reward components of a PPO env (``env.reward_components``) and their weights (``env.reward_weights``):
read from the step info, logged per episode, kept in the trajectory record, and trained on as
r' = r + sum_k (w_k - 1) * c_k."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import ray
from gymnasium import spaces

import rlfabric
from rlfabric.actors.env_runner import EnvRunnerCore
from rlfabric.actors.learner import LearnerCore
from rlfabric.cli import main
from rlfabric.config import ConfigError
from rlfabric.config import ppo_config_from_dict as config_from_dict
from rlfabric.driver import Trainer
from rlfabric.normalization import discounted_returns
from rlfabric.reward_shaping import MissingRewardComponent, component_metric, components_read, shaped_reward
from rlfabric.runner_pool import RunAbortedError
from rlfabric.vector import EnvVector, NonFiniteEnvOutput

EPISODE = 10  # steps of every SafetyEnv episode


class SafetyEnv(gym.Env):
    """Episodes of exactly ``EPISODE`` steps; each step's info holds ``reward_progress`` (1 for action 1, else 0)
    and ``reward_safety`` (-0.5 every step), and its reward is their sum. ``safety_from``: the step of an episode
    from which info has ``reward_safety`` (1: always); ``nan_safety_at``: the step whose safety is NaN."""

    metadata = {"render_modes": []}

    def __init__(self, safety_from: int = 1, nan_safety_at: int | None = None) -> None:
        self.observation_space = spaces.Box(-1.0, 1.0, shape=(3,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.safety_from, self.nan_safety_at, self.t = safety_from, nan_safety_at, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), {}

    def step(self, action):
        self.t += 1
        progress = float(action == 1)
        info = {"reward_progress": progress, "x_position": 0.0}
        if self.t >= self.safety_from:
            info["reward_safety"] = float("nan") if self.t == self.nan_safety_at else -0.5
        obs = self.np_random.uniform(-1, 1, 3).astype(np.float32)
        return obs, progress - 0.5, False, self.t >= EPISODE, info


ENV = "test_components/safety"
rlfabric.register_env(ENV, SafetyEnv)


# -- the math --------------------------------------------------------------------------------------------------


def test_shaped_reward_reweights_each_named_term():
    rng = np.random.default_rng(0)
    forward, ctrl, rest = (rng.normal(size=(5, 3)).astype(np.float32) for _ in range(3))
    reward = forward + ctrl + rest
    components = {"reward_forward": forward, "reward_ctrl": ctrl}
    assert shaped_reward(reward, components, {}) is reward  # no weights: the env's reward itself
    np.testing.assert_array_equal(shaped_reward(reward, components, {"reward_ctrl": 1.0}), reward)
    np.testing.assert_allclose(
        shaped_reward(reward, components, {"reward_forward": 2.0, "reward_ctrl": 0.0}),
        2 * forward + rest,
        rtol=1e-5,
        atol=1e-5,
    )
    out = shaped_reward(reward, components, {"reward_ctrl": -1.5})  # r + (w - 1) c
    np.testing.assert_allclose(out, reward - 2.5 * ctrl, rtol=1e-5, atol=1e-5)
    assert out.dtype == np.float32


def test_the_keys_read_are_the_components_then_the_other_weighted_keys():
    assert components_read([], {}) == ()
    assert components_read(["b", "a"], {"a": 2.0, "c": 0.5}) == ("b", "a", "c")
    assert component_metric("reward_forward") == "episode_reward_forward"
    assert component_metric("safety") == "episode_reward_safety"


# -- reading them: EnvVector and the runner --------------------------------------------------------------------


def test_the_vector_reads_components_each_step_and_sums_them_per_episode():
    vec = EnvVector([SafetyEnv(), SafetyEnv()], name=ENV, components=("reward_safety", "reward_progress"))
    vec.reset([0, 1])
    for t in range(EPISODE):
        step = vec.step(np.array([1, t % 2]))
        np.testing.assert_array_equal(step.components, [[-0.5, -0.5], [1.0, t % 2]])
    assert step.episode_returns == [EPISODE * 0.5, 0.0]
    np.testing.assert_array_equal(step.episode_components, [[-5.0, 10.0], [-5.0, 5.0]])
    plain = EnvVector([SafetyEnv()])
    plain.reset([0])
    assert plain.step(np.array([0])).components is None  # none named: info is not read


def test_a_key_missing_from_info_is_one_line_naming_it_and_the_keys_the_env_gave():
    vec = EnvVector([SafetyEnv(safety_from=3)], name=ENV, components=("reward_progress", "reward_safety"))
    vec.reset([0])
    with pytest.raises(MissingRewardComponent) as info:
        vec.step(np.array([1]))
    assert str(info.value) == (
        f"env {ENV!r} gave no 'reward_safety' in its step info, which env.reward_components / env.reward_weights "
        "name; the keys it gave: 'reward_progress', 'x_position'"
    )


@pytest.mark.parametrize(
    "key, says",
    [
        (
            "reward_progres",
            "gave no 'reward_progres' in its step info, which env.reward_components / "
            "env.reward_weights name; did you mean 'reward_progress'? the keys it gave: 'reward_progress', "
            "'reward_safety', 'x_position'",
        ),
        (
            "reward_fly",
            "gave no 'reward_fly' in its step info, which env.reward_components / env.reward_weights "
            "name; the keys it gave: 'reward_progress', 'reward_safety', 'x_position'",
        ),
    ],
)
def test_train_refuses_a_component_the_envs_step_lacks_before_ray(key, says, no_ray, tmp_path, capsys):
    run = ["train", "algo=ppo", f"env.id={ENV}", f"env.reward_components=[{key}]", "--run-dir", str(tmp_path / "r")]
    assert main([*run, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"rlfabric: config error: env.id = {ENV!r}: step() {says}"
    assert not ray.is_initialized()


def test_a_non_finite_component_is_the_envs_error():
    vec = EnvVector([SafetyEnv(nan_safety_at=4)], name=ENV, components=("reward_safety",))
    vec.reset([0])
    for _ in range(3):
        vec.step(np.array([1]))
    with pytest.raises(NonFiniteEnvOutput, match=r"non-finite reward component 'reward_safety' \(nan\) at step 4 "):
        vec.step(np.array([1]))


def _runner(weights: dict[str, float] | None = None, components: tuple[str, ...] = ("reward_progress",)):
    runner = EnvRunnerCore(
        ENV, {}, 2, 16, seed=3, gamma=0.9, obs_clip=10.0, reward_components=components, reward_weights=weights
    )
    cfg = _config(list(components), weights or {})
    learner = LearnerCore(cfg.to_dict(), runner.obs_dim, runner.action)
    runner.set_weights(learner.weights())
    return runner, learner


def _config(components: list[str], weights: dict[str, float], **training) -> rlfabric.Config:
    return config_from_dict(
        {
            "env": {"id": ENV, "reward_components": components, "reward_weights": weights},
            "runners": {"num_runners": 1, "envs_per_runner": 2},
            "ppo": {"train_batch_size": 32, "minibatch_size": 16, "num_epochs": 2},
            "model": {"hidden_sizes": [8]},
            "training": {"total_env_steps": 320, "eval_episodes": 0, **training},
        }
    )


def test_the_runner_records_components_and_logs_their_episode_sums():
    runner, _ = _runner({"reward_safety": 3.0})  # a weighted key is read too
    meta, record = runner.sample()
    assert set(record.rewards) == {"env", "reward_progress", "reward_safety"}
    np.testing.assert_array_equal(record.rewards["reward_safety"], np.full((2, 16), -0.5, np.float32))
    np.testing.assert_array_equal(record.rewards["env"], record.rewards["reward_progress"] - 0.5)
    assert meta["episode_components"]["reward_safety"] == [-5.0, -5.0]  # one episode per env ended in 16 steps
    progress = meta["episode_components"]["reward_progress"]
    np.testing.assert_allclose(np.array(progress) - 5.0, meta["episode_returns"])  # the env's own return
    # the return statistics (reward scaling) are of the reward trained on: r + (3 - 1) * safety = r - 1
    trained = (record.rewards["env"] - 1.0).T
    dones = (record.terminated | record.truncated).T
    returns, _ = discounted_returns(trained, dones, 0.9, np.zeros(2))
    np.testing.assert_allclose(record.extras["return_stats"]["mean"], [returns.mean()], rtol=1e-5)


def test_the_learner_trains_on_the_weighted_reward():
    """GAE of a record with weights equals GAE of the same record, unweighted, whose env reward is r'."""
    runner, weighted = _runner({"reward_progress": 0.0}, components=("reward_progress",))
    _, record = runner.sample()
    plain = LearnerCore(_config(["reward_progress"], {}).to_dict(), runner.obs_dim, runner.action)
    shaped = record.select(np.ones(record.num_rows, bool))
    shaped.rewards["env"] = record.rewards["env"] - record.rewards["reward_progress"]  # w = 0: progress taken out
    np.testing.assert_allclose(shaped.rewards["env"], np.full((2, 16), -0.5, np.float32))
    got, want = weighted._advantages(record), plain._advantages(shaped)
    np.testing.assert_allclose(got["advantages"], want["advantages"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["returns"], want["returns"], rtol=1e-5, atol=1e-6)


def test_halfcheetah_components_add_up_to_its_reward():
    """Gymnasium's HalfCheetah-v5: reward = reward_forward + reward_ctrl, so weighting reward_ctrl by w trains on
    reward_forward + w * reward_ctrl."""
    pytest.importorskip("mujoco")
    keys = ("reward_forward", "reward_ctrl")
    runner = EnvRunnerCore("gym:HalfCheetah-v5", {}, 2, 8, seed=0, gamma=0.99, obs_clip=10.0, reward_components=keys)
    runner.set_weights(LearnerCore(_config([], {}).to_dict(), runner.obs_dim, runner.action).weights())
    _, record = runner.sample()
    r, forward, ctrl = (record.rewards[k] for k in ("env", *keys))
    assert (ctrl < 0).all()  # a cost
    np.testing.assert_allclose(r, forward + ctrl, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        shaped_reward(r, record.rewards, {"reward_ctrl": 0.25}), forward + 0.25 * ctrl, rtol=1e-5, atol=1e-6
    )


# -- config and resume -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, said",
    [
        ({"reward_components": ["a", "a"]}, "env.reward_components[1] = 'a' is not valid: is listed twice"),
        ({"reward_components": ["env"]}, "env.reward_components[0] = 'env' is not valid: is the name of the env's"),
        ({"reward_components": [""]}, "env.reward_components[0] = '' is not valid: must be an info key"),
        ({"reward_weights": {"env": 2}}, "env.reward_weights.env = 2.0 is not valid: 'env' is the env's own reward"),
        ({"reward_weights": {"a": "nan"}}, "env.reward_weights.a = 'nan' is not valid: expected a finite number"),
        ({"reward_components": "a"}, "env.reward_components = 'a' is not valid: expected a list of strings"),
        (
            {"reward_components": ["reward_x"], "reward_weights": {"x": 2}},
            "env.reward_components = ['reward_x', 'x'] is not valid: both would be logged as episode_reward_x",
        ),
    ],
)
def test_bad_component_settings_are_one_line_config_errors(env, said):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"env": env})
    assert str(info.value).startswith(said) and "\n" not in str(info.value)


def test_resume_keeps_the_weights_and_may_change_the_components(tmp_path):
    from rlfabric.config import dump_config

    cfg = _config(["reward_progress"], {"reward_safety": 2.0})
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "iter_000003.pt").write_bytes(b"")
    with pytest.raises(
        ConfigError,
        match=r"^env.reward_weights = \{'reward_safety': 0.5\} is not valid with --resume: the checkpoint was "
        r"trained with \{'reward_safety': 2.0\}",
    ):
        Trainer.from_run_dir(tmp_path, ["env.reward_weights={reward_safety: 0.5}"])
    resumed = Trainer.from_run_dir(tmp_path, ["env.reward_components=[reward_progress, x_position]"])
    assert resumed.cfg.env.reward_components == ["reward_progress", "x_position"]


def test_a_game_refuses_reward_components(tmp_path):
    from rlfabric.game_driver import ppo_trainer

    cfg = config_from_dict({"env": {"id": "pettingzoo:classic.tictactoe_v3", "reward_weights": {"x": 2.0}}})
    with pytest.raises(ConfigError, match=r"^env.reward_weights is set, but env.id = .* is a game"):
        ppo_trainer(cfg, tmp_path / "run", quiet=True)


# -- runs ------------------------------------------------------------------------------------------------------


def test_a_run_logs_each_components_episode_mean(local_ray, tmp_path, train):
    summary, rows = train(_config(["reward_progress", "reward_safety"], {"reward_safety": 2.0}), tmp_path / "run")
    assert summary["env_steps"] == 320
    for row in rows:  # each iteration's 32 steps end 2 or 4 episodes of 10 steps
        assert row["episode_reward_safety"] == pytest.approx(-0.5 * EPISODE)
        assert 0 <= row["episode_reward_progress"] <= EPISODE
    # The first row's episodes are all the run's so far, so its return (the env's own, whatever the weights) is
    # the sum of its components' means.
    first = rows[0]
    want = first["episode_reward_progress"] + first["episode_reward_safety"]
    assert first["episode_return_mean"] == pytest.approx(want)
    assert all(row["skipped_updates"] == 0 for row in rows)


def test_a_run_whose_env_lacks_a_component_stops_at_once(local_ray, tmp_path):
    trainer = Trainer(_config(["reward_progress", "reward_fly"], {}), tmp_path / "run", quiet=True)
    try:
        with pytest.raises(RunAbortedError) as info:
            trainer.train()
        assert trainer.pool.restarts == 0  # not retried: every runner would fail the same way
    finally:
        trainer.close()
    message = str(info.value)
    assert message.startswith(f"runner 0: env {ENV!r} gave no 'reward_fly' in its step info") or message.startswith(
        f"runner 1: env {ENV!r} gave no 'reward_fly' in its step info"
    )
    assert message.endswith("the keys it gave: 'reward_progress', 'reward_safety', 'x_position'")
