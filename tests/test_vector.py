"""Same-step autoreset in EnvVector, and the fragments EnvRunnerCore builds on top of it."""

import numpy as np
import pytest
import torch
from gymnasium import Env, spaces
from gymnasium.wrappers import TimeLimit

import rlfabric
from rlfabric.actors.env_runner import EnvRunnerCore
from rlfabric.actors.learner import LearnerCore
from rlfabric.config import ppo_config_from_dict as config_from_dict
from rlfabric.trajectory import time_major
from rlfabric.vector import EnvVector


class CounterEnv(Env):
    """obs = [steps taken in this episode, episode number (1 = first)]; reward = action + 1.

    mode "terminate" / "truncate": every episode ends that way after ``k`` steps;
    mode "alternate": odd episodes terminate after k + offset steps, even ones truncate after k + 1 + offset;
    mode "action": an episode terminates when action 0 is taken (wrap in a TimeLimit to truncate);
    mode "never": episodes never end on their own.
    ``offset`` is the first reset's seed mod 3, so envs of one vector fall out of step.
    Every call is recorded: the actions ``step`` received and the number of resets.
    """

    metadata = {"render_modes": []}

    def __init__(self, k: int = 3, mode: str = "terminate") -> None:
        self.observation_space = spaces.Box(-np.inf, np.inf, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Discrete(3)
        self.k, self.mode = k, mode
        self.offset = 0
        self.t = 0
        self.episode = 0
        self.resets = 0
        self.actions: list[int] = []

    def _obs(self):
        return np.array([self.t, self.episode], np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None and self.resets == 0:
            self.offset = seed % 3
        self.t = 0
        self.episode += 1
        self.resets += 1
        return self._obs(), {}

    def step(self, action):
        action = int(action)
        self.actions.append(action)
        self.t += 1
        terminated = truncated = False
        if self.mode == "terminate":
            terminated = self.t >= self.k
        elif self.mode == "truncate":
            truncated = self.t >= self.k
        elif self.mode == "alternate":
            if self.episode % 2 == 1:
                terminated = self.t >= self.k + self.offset
            else:
                truncated = self.t >= self.k + 1 + self.offset
        elif self.mode == "action":
            terminated = action == 0
        return self._obs(), float(action + 1), terminated, truncated, {}


def make_counter(mode: str = "terminate", k: int = 3, time_limit: int | None = None) -> Env:
    env = CounterEnv(k=k, mode=mode)
    return TimeLimit(env, max_episode_steps=time_limit) if time_limit else env


ENV_NAME = "test_vector/Counter-v0"
rlfabric.register_env(ENV_NAME, make_counter)


# -- EnvVector ------------------------------------------------------------------------------------------


def _vector(*envs):
    return EnvVector(list(envs))


def test_step_resets_in_the_same_step():
    vec = _vector(make_counter("terminate", k=2), make_counter("truncate", k=3))
    obs = vec.reset([0, 1])
    np.testing.assert_array_equal(obs, [[0, 1], [0, 1]])
    assert obs.dtype == np.float32

    s = vec.step(np.array([1, 2]))
    np.testing.assert_array_equal(s.obs, [[1, 1], [1, 1]])
    np.testing.assert_array_equal(s.rewards, [2.0, 3.0])
    assert s.final_obs == {} and s.episode_returns == [] and s.episode_lengths == []

    # env 0 terminates on its 2nd step: the returned obs is already the next episode's reset obs
    s = vec.step(np.array([0, 0]))
    np.testing.assert_array_equal(s.obs, [[0, 2], [2, 1]])
    np.testing.assert_array_equal(s.terminated, [True, False])
    np.testing.assert_array_equal(s.truncated, [False, False])
    assert list(s.final_obs) == [0]
    np.testing.assert_array_equal(s.final_obs[0], [2, 1])
    assert s.episode_returns == [2.0 + 1.0] and s.episode_lengths == [2]

    # env 1 is truncated on its 3rd step
    s = vec.step(np.array([2, 1]))
    np.testing.assert_array_equal(s.obs, [[1, 2], [0, 2]])
    np.testing.assert_array_equal(s.terminated, [False, False])
    np.testing.assert_array_equal(s.truncated, [False, True])
    assert list(s.final_obs) == [1]
    np.testing.assert_array_equal(s.final_obs[1], [3, 1])
    assert s.episode_returns == [3.0 + 1.0 + 2.0] and s.episode_lengths == [3]

    # the returns restart from zero after the reset
    s = vec.step(np.array([2, 2]))
    np.testing.assert_array_equal(s.obs, [[0, 3], [1, 2]])
    assert s.episode_returns == [3.0 + 3.0] and s.episode_lengths == [2]  # env 0: actions 2, 2


def test_time_limit_truncation_resets_in_the_same_step():
    vec = _vector(make_counter("never", time_limit=2), make_counter("never", time_limit=3))
    vec.reset([0, 0])
    vec.step(np.array([0, 0]))
    s = vec.step(np.array([1, 1]))
    np.testing.assert_array_equal(s.truncated, [True, False])
    np.testing.assert_array_equal(s.terminated, [False, False])
    np.testing.assert_array_equal(s.obs, [[0, 2], [2, 1]])
    np.testing.assert_array_equal(s.final_obs[0], [2, 1])
    assert s.episode_returns == [1.0 + 2.0] and s.episode_lengths == [2]
    s = vec.step(np.array([2, 2]))
    np.testing.assert_array_equal(s.truncated, [False, True])
    np.testing.assert_array_equal(s.obs, [[1, 2], [0, 2]])
    np.testing.assert_array_equal(s.final_obs[1], [3, 1])
    assert s.episode_returns == [1.0 + 2.0 + 3.0] and s.episode_lengths == [3]


def test_every_action_is_applied_over_a_long_run():
    envs = [
        make_counter("terminate", k=1),  # ends on every step
        make_counter("truncate", k=4),
        make_counter("action"),
        make_counter("never", time_limit=5),
        make_counter("action", time_limit=3),
    ]
    vec = _vector(*envs)
    vec.reset(list(range(len(envs))))
    rng = np.random.default_rng(0)
    steps = 300
    sent = rng.integers(0, 3, size=(steps, len(envs)))
    ended = np.zeros(len(envs), int)
    returns: list[list[float]] = [[] for _ in envs]
    lengths: list[list[int]] = [[] for _ in envs]
    obs = None
    for t in range(steps):
        s = vec.step(sent[t])
        ended += s.terminated | s.truncated
        done = np.flatnonzero(s.terminated | s.truncated)
        for i, r, n in zip(done, s.episode_returns, s.episode_lengths, strict=True):
            returns[i].append(r)
            lengths[i].append(n)
        obs = s.obs
    for i, env in enumerate(envs):
        inner = env.unwrapped
        # every action reached the env, in order: no step was spent on an action-ignoring reset transition
        assert len(inner.actions) == steps
        np.testing.assert_array_equal(inner.actions, sent[:, i])
        assert inner.resets == 1 + ended[i]
        # completed episodes plus the one in progress account for every step and every reward
        assert sum(lengths[i]) + int(obs[i, 0]) == steps
        in_progress = float(np.sum(sent[steps - int(obs[i, 0]) :, i] + 1))
        assert sum(returns[i]) + in_progress == pytest.approx(float(np.sum(sent[:, i] + 1)))
    assert ended[0] == steps
    assert lengths[1] == [4] * (steps // 4)
    assert all(n <= 5 for n in lengths[3]) and lengths[3][0] == 5
    assert ended[2] > 10 and ended[4] > 10


class _BoxEnv(Env):
    def __init__(self):
        self.observation_space = spaces.Box(-np.inf, np.inf, shape=(1,), dtype=np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.actions = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.actions.append(np.array(action))
        return np.zeros(1, np.float32), 0.0, False, False, {}


def test_box_actions_are_clipped_to_the_space():
    env = _BoxEnv()
    vec = _vector(env)
    vec.reset([0])
    vec.step(np.array([[3.0, -0.25]], np.float32))
    np.testing.assert_array_equal(env.actions[0], [1.0, -0.25])


# -- EnvRunnerCore --------------------------------------------------------------------------------------

T, N = 24, 3


def _flags_alternate(episode, count, action, offset, k=3):
    if episode % 2 == 1:
        return count >= k + offset, False
    return False, count >= k + 1 + offset


def _flags_action_time_limit(episode, count, action, offset, limit=4):
    return action == 0, count >= limit


VARIANTS = {
    "alternate": ({"mode": "alternate", "k": 3}, _flags_alternate),
    "timelimit": ({"mode": "action", "time_limit": 4}, _flags_action_time_limit),
}


def _runner_and_learner(env_kwargs, normalize_obs=False, seed=5):
    runner = EnvRunnerCore(ENV_NAME, env_kwargs, N, T, seed=seed, gamma=0.9, obs_clip=10.0)
    cfg = config_from_dict(
        {
            "env": {"id": ENV_NAME, "kwargs": env_kwargs},
            "runners": {"num_runners": 1, "envs_per_runner": N},
            "ppo": {
                "train_batch_size": T * N,
                "minibatch_size": T * N // 2,
                "num_epochs": 2,
                "normalize_obs": normalize_obs,
            },
            "model": {"hidden_sizes": [16]},
            "training": {"total_env_steps": 10 * T * N},
        }
    )
    spaces_ = runner.spaces()
    learner = LearnerCore(cfg.to_dict(), spaces_["obs_dim"], spaces_["action"])
    runner.set_weights(learner.weights())
    return runner, learner


def time_major_view(traj) -> dict:
    """A runner's record (one row per env) as the [T, N, ...] arrays a vector env steps through."""
    return {
        "obs": time_major(traj.obs),
        "actions": time_major(traj.actions),
        "terminated": time_major(traj.terminated),
        "truncated": time_major(traj.truncated),
        "rewards": time_major(traj.rewards["env"]),
        "last_obs": traj.bootstrap_obs,
        "truncated_index": traj.truncation_index[:, ::-1],
        "truncated_obs": traj.truncation_obs,
        **traj.extras,
    }


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_runner_fragment_truncation_bookkeeping(variant):
    env_kwargs, expected_flags = VARIANTS[variant]
    runner, _ = _runner_and_learner(env_kwargs)
    offsets = [env.unwrapped.offset for env in runner.envs.envs]
    if variant == "alternate":
        assert len(set(offsets)) == N  # the envs really are out of step

    for _ in range(2):  # the second fragment continues where the first stopped
        start_obs = runner.raw_obs.copy()
        meta, traj = runner.sample()
        frag = time_major_view(traj)
        obs, act = frag["obs"], frag["actions"]
        term, trunc = frag["terminated"], frag["truncated"]
        assert obs.shape == (T, N, 2) and act.shape == (T, N)
        np.testing.assert_array_equal(obs[0], start_obs)
        np.testing.assert_array_equal(frag["rewards"], act + 1)

        nxt = np.concatenate([obs[1:], frag["last_obs"][None]])
        for t in range(T):
            for n in range(N):
                count, episode = obs[t, n]
                want = expected_flags(int(episode), int(count) + 1, int(act[t, n]), offsets[n])
                assert (bool(term[t, n]), bool(trunc[t, n])) == want, (t, n)
                if term[t, n] or trunc[t, n]:
                    # the row after an episode's end is the next episode's reset obs
                    np.testing.assert_array_equal(nxt[t, n], [0, episode + 1])
                else:
                    # otherwise the next row is the same episode one step on: no row pair spans two episodes
                    np.testing.assert_array_equal(nxt[t, n], [count + 1, episode])

        only_trunc = trunc & ~term
        assert only_trunc.sum() >= 2 and term.sum() >= 2
        np.testing.assert_array_equal(frag["truncated_index"], np.argwhere(only_trunc))
        assert frag["truncated_index"].dtype == np.int64
        # each truncated_obs row is that episode's final obs, not the reset obs stored in the next row
        final = [[obs[t, n, 0] + 1, obs[t, n, 1]] for t, n in np.argwhere(only_trunc)]
        np.testing.assert_array_equal(frag["truncated_obs"], final)

        stats = frag["obs_stats"]
        assert stats["count"] == T * N
        np.testing.assert_allclose(stats["mean"], obs.reshape(-1, 2).mean(0), rtol=1e-6)
        assert frag["return_stats"]["count"] == T * N
        assert meta["env_steps"] == T * N
        # episodes are reported in step order, env order within a step, with their full lengths
        ends = np.argwhere(term | trunc)
        assert meta["episode_lengths"] == [int(obs[t, n, 0]) + 1 for t, n in ends]
        assert len(meta["episode_returns"]) == len(ends)

    # every action the runner chose was applied by its env
    for env in runner.envs.envs:
        assert len(env.unwrapped.actions) == 2 * T


def test_runner_with_time_limit_equal_to_termination_step_is_not_a_truncation():
    # odd episodes terminate on step 4 where the TimeLimit also fires: terminated wins, no bootstrap
    runner, _ = _runner_and_learner({"mode": "alternate", "k": 4, "time_limit": 4})
    for env in runner.envs.envs:  # same offset everywhere so the coincidence happens
        env.unwrapped.offset = 0
    frag = time_major_view(runner.sample()[1])
    both = frag["terminated"] & frag["truncated"]
    assert both.sum() >= N
    listed = {tuple(ix) for ix in frag["truncated_index"]}
    assert not listed & {tuple(ix) for ix in np.argwhere(both)}
    np.testing.assert_array_equal(frag["truncated_index"], np.argwhere(frag["truncated"] & ~frag["terminated"]))


@pytest.mark.parametrize("normalize_obs", [False, True])
def test_runner_logp_matches_learner_before_and_after_an_update(normalize_obs):
    """The fragment stores obs as the policy saw them, so the learner's ratio is exactly 1 on a fresh policy."""
    runner, learner = _runner_and_learner({"mode": "alternate", "k": 3}, normalize_obs=normalize_obs)
    for _ in range(2):
        _, frag = runner.sample()
        obs = torch.as_tensor(frag.obs.reshape(T * N, 2))
        logp, _, _ = learner.model.evaluate(obs, torch.as_tensor(frag.actions.reshape(-1)))
        np.testing.assert_allclose(logp.detach().numpy(), frag.logprobs.reshape(-1), atol=1e-5)
        learner.update([frag])
        assert runner.set_weights(learner.weights()) == learner.version
    if normalize_obs:
        assert learner.obs_stats.count == 2 * T * N
        np.testing.assert_allclose(runner.policy.normalizer.mean, learner.obs_stats.mean, rtol=1e-6)


def test_discrete_actions_are_shifted_onto_a_space_with_a_start():
    """Discrete(3, start=-1): the policy's 0, 1, 2 reach the env as -1, 0, 1."""

    class Shifted(Env):
        observation_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
        action_space = spaces.Discrete(3, start=-1)

        def reset(self, *, seed=None, options=None):
            return np.zeros(1, np.float32), {}

        def step(self, action):
            assert self.action_space.contains(action), action
            return np.array([action], np.float32), 0.0, False, False, {}

    vec = EnvVector([Shifted()])
    vec.reset([0])
    assert [float(vec.step(np.array([a])).obs[0, 0]) for a in (0, 1, 2)] == [-1.0, 0.0, 1.0]
