"""Multi-agent games: per-agent steps and rewards, action masks, policy mapping, the learner's ragged rows."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pettingzoo
import pytest
import torch
from game_envs import broken_relay

from rlfabric.actors.game_runner import GameRunnerCore
from rlfabric.algorithms import ppo
from rlfabric.config import load_config
from rlfabric.models import ActorCritic, NumpyPolicy
from rlfabric.multiagent.games import GameCopy
from rlfabric.multiagent.mapping import map_agents
from rlfabric.multiagent.spaces import agent_spaces
from rlfabric.vector import NonFiniteEnvOutput

warnings.filterwarnings("ignore", category=DeprecationWarning)


def tictactoe():
    return pettingzoo.make("aec", "classic/tictactoe-v3")


def scripted_copy(moves: list[int]) -> tuple[GameCopy, list]:
    """A tic-tac-toe copy whose agents play ``moves`` in turn; returns it and the finished episodes."""
    env = tictactoe()
    env.reset(seed=0)
    spaces = {a: agent_spaces(env.observation_space(a), env.action_space(a), a) for a in env.possible_agents}
    copy = GameCopy(0, env, spaces, None, lambda _: {a: "main" for a in env.possible_agents}, lambda _: True)
    ends = copy.reset(0)
    for move in moves:
        (request,) = copy.requests()
        ends += copy.apply([(request, move, -0.5, 3)])
    return copy, ends


def rows_by_agent(copy: GameCopy) -> dict[str, object]:
    return {agent: stream for agent, _, stream in copy.take_rows()}


def test_a_turn_based_win_puts_each_players_outcome_on_its_own_last_move():
    # player_1 takes the top row (cells 0, 3, 6 in PettingZoo's column-major board), player_2 plays 1 and 4
    copy, ends = scripted_copy([0, 1, 3, 4, 6])
    assert len(ends) == 1 and ends[0].returns == {"player_1": 1.0, "player_2": -1.0}
    rows = rows_by_agent(copy)
    assert rows["player_1"].actions == [0, 3, 6] and rows["player_2"].actions == [1, 4]
    assert rows["player_1"].rewards == [0.0, 0.0, 1.0]
    assert rows["player_2"].rewards == [0.0, -1.0]  # the loss lands on player_2's last move, not on player_1's
    assert rows["player_1"].terminated == [False, False, True]
    assert rows["player_2"].terminated == [False, True]
    assert rows["player_1"].logprobs == [-0.5] * 3 and rows["player_1"].versions == [3] * 3


def test_an_open_step_carries_over_into_the_next_fragment():
    copy, _ = scripted_copy([4, 0, 8])  # player_1 moved last: its step waits for player_2's reply
    first = rows_by_agent(copy)
    assert first["player_1"].actions == [4] and first["player_2"].actions == [0]
    (request,) = copy.requests()
    copy.apply([(request, 2, 0.0, 0)])  # player_2 replies: player_1's move 8 closes, player_2's 2 is now open
    assert {a: s.actions for a, s in rows_by_agent(copy).items()} == {"player_1": [8]}
    (request,) = copy.requests()
    copy.apply([(request, 1, 0.0, 0)])
    assert {a: s.actions for a, s in rows_by_agent(copy).items()} == {"player_2": [2]}


def test_masks_reach_the_record_and_masked_actions_are_never_sampled():
    env = tictactoe()
    env.reset(seed=0)
    spaces = agent_spaces(env.observation_space("player_1"), env.action_space("player_1"))
    model = ActorCritic(spaces.obs_dim, spaces.action, [16])
    with torch.no_grad():
        model.actor[-1].bias[:] = torch.tensor([9.0, 9.0, 0, 0, 0, 0, 0, 0, 0])  # the net prefers 0 and 1
    mask = np.zeros((4000, 9), bool)
    mask[:, 5] = mask[:, 7] = True
    obs = np.zeros((4000, spaces.obs_dim), np.float32)
    actions, logp = NumpyPolicy(model.actor_arrays()).act(obs, np.random.default_rng(0), mask=mask)
    assert set(actions.tolist()) == {5, 7}
    new_logp, _, _ = model.evaluate(torch.as_tensor(obs[:2]), torch.as_tensor(actions[:2]), torch.as_tensor(mask[:2]))
    np.testing.assert_allclose(new_logp.detach().numpy(), logp[:2], atol=1e-5)
    np.testing.assert_allclose(np.exp(logp[:2]), [0.5, 0.5], atol=1e-5)  # equal logits on the two legal cells


def test_samples_send_no_illegal_move_and_keep_the_masks():
    # the guarded game raises on a move its mask forbids (tic-tac-toe itself would only end the game with a -1)
    cfg = load_config(None, ["algo=ppo", "env.id=game_envs:guarded_tictactoe", "multi_agent.policies={main: {}}"])
    runner = GameRunnerCore(cfg.env.id, {}, 4, 64, 0, cfg.multi_agent, 10.0)
    info = runner.spaces_info()["main"]
    runner.set_weights(
        {"actor": ActorCritic(info["obs_dim"], info["action"], [8]).actor_arrays(), "version": 0, "obs_stats": None}
    )
    ids = []
    for _ in range(3):
        ids += runner.sample()[1].episode_id.tolist()
    meta, frag = runner.sample()
    ids += frag.episode_id.tolist()
    assert len(ids) == len(set(ids))  # row ids stay unique across fragments
    assert meta["episode_returns"] and frag.action_mask is not None
    steps = frag.loss_mask > 0
    chosen = np.take_along_axis(frag.action_mask, frag.actions[..., None], axis=-1)[..., 0]
    assert chosen[steps].all()  # each recorded action was legal under its recorded mask
    assert (~frag.action_mask[steps]).any()  # and the masks are real: some moves were illegal
    assert set(frag.agent_id) == {"player_1", "player_2"} and set(frag.policy_id) == {"main"}


def test_a_text_observation_is_said_to_be_character_indices_not_one_hot():
    """Gymnasium flattens Text to character indices: envs check must not call that one-hot."""
    text = gym.spaces.Dict({"board": gym.spaces.Box(0, 1, (2,)), "note": gym.spaces.Text(3)})
    discrete = gym.spaces.Dict({"board": gym.spaces.Box(0, 1, (2,)), "turn": gym.spaces.Discrete(3)})
    [text_note, _] = agent_spaces(text, gym.spaces.Discrete(2), "p").notes
    [discrete_note, _] = agent_spaces(discrete, gym.spaces.Discrete(2), "p").notes
    assert "its text as character indices (not one-hot)" in text_note and "kind: llm" in text_note
    assert "one-hot for discrete parts" in discrete_note and "text" not in discrete_note


def test_policy_mapping_gives_each_policy_only_its_agents_rows():
    cfg = load_config(
        None,
        [
            "algo=ppo",
            "env.id=pettingzoo:classic.tictactoe_v3",
            "multi_agent.policies={first: {}, second: {}}",
            "multi_agent.policy_mapping={player_1: first, player_2: second}",
        ],
    )
    runner = GameRunnerCore(cfg.env.id, {}, 2, 32, 0, cfg.multi_agent, 10.0)
    info = runner.spaces_info()
    weights = [
        {
            "actor": ActorCritic(info[p]["obs_dim"], info[p]["action"], [8]).actor_arrays(),
            "version": 0,
            "obs_stats": None,
        }
        for p in ("first", "second")
    ]
    runner.set_weights(*weights)
    _, first, second = runner.sample()
    assert set(first.agent_id) == {"player_1"} and set(first.policy_id) == {"first"}
    assert set(second.agent_id) == {"player_2"} and set(second.policy_id) == {"second"}


def test_map_agents_by_pattern_and_an_unmapped_agent_is_named():
    agents = ["adversary_0", "agent_0", "agent_1"]
    assert map_agents(agents, {"adversary_*": "red", "agent_*": "blue"}, ["red", "blue"]) == {
        "adversary_0": "red",
        "agent_0": "blue",
        "agent_1": "blue",
    }
    with pytest.raises(ValueError, match="'agent_0' matches none"):
        map_agents(agents, {"adversary_*": "red"}, ["red"])


def test_row_next_values_by_hand():
    values = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]], np.float32)
    got = ppo.row_next_values(
        values,
        np.array([3, 2]),
        np.array([10.0, 20.0], np.float32),
        np.array([[0, 0]]),  # row 0 was truncated after its first step
        np.array([7.0], np.float32),
    )
    np.testing.assert_array_equal(got, [[7.0, 3.0, 10.0], [5.0, 20.0, 0.0]])


def test_value_normalization_round_trip_by_hand():
    np.testing.assert_allclose(ppo.normalize_values(np.array([3.0, 5.0]), 4.0, 4.0, eps=0.0), [-0.5, 0.5])
    np.testing.assert_allclose(ppo.denormalize_values(np.array([-0.5, 0.5]), 4.0, 4.0, eps=0.0), [3.0, 5.0])


def test_centralized_critic_sees_the_global_state_and_the_agent():
    cfg = load_config(None, ["algo=ppo", "env.id=mpe2:simple_spread_v3", "multi_agent.critic=centralized"])
    runner = GameRunnerCore(cfg.env.id, {}, 2, 5, 0, cfg.multi_agent, 10.0)
    info = runner.spaces_info()["shared"]
    assert info["critic_dim"] == 54 + 3  # state() of 3 agents' 18 observations, then the agent's one-hot
    runner.set_weights(
        {"actor": ActorCritic(info["obs_dim"], info["action"], [8]).actor_arrays(), "version": 0, "obs_stats": None}
    )
    _, frag = runner.sample()
    assert frag.critic_obs.shape == (6, 5, 57) and frag.bootstrap_critic_obs.shape == (6, 57)
    for row, agent in enumerate(frag.agent_id):
        one_hot = frag.critic_obs[row, :, 54:]
        assert (one_hot == np.eye(3)[["agent_0", "agent_1", "agent_2"].index(agent)]).all()


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            ["multi_agent.policies={main: {}, opp: {}}", "multi_agent.policy_mapping={player_1: main}"],
            r"agent 'player_2' matches none of \['player_1'\]",
        ),
        (
            ["multi_agent.policies={main: {}, opp: {}}", "multi_agent.policy_mapping={'player_*': main}"],
            r"trainable policy 'opp' plays no agent",
        ),
        (
            [
                "multi_agent.policies={main: {}, opp: {kind: scripted, rule: 'nowhere.module:rule'}}",
                "multi_agent.policy_mapping={player_1: main, player_2: opp}",
            ],
            r"multi_agent.policies.opp.rule = 'nowhere.module:rule' is not valid",
        ),
        (  # a learning rate on a neural policy would be ignored: its learner takes ppo.lr
            ["multi_agent.policies={main: {lr: 0.0003}}"],
            r"multi_agent.policies.main.lr = 0.0003 is not valid: a neural policy does not use it, only llm with "
            r"train: true does \(a neural policy learns with the ppo section's settings: ppo.lr",
        ),
        (
            [
                "multi_agent.policies={main: {}, opp: {kind: random, checkpoint: runs/old}}",
                "multi_agent.policy_mapping={player_1: main, player_2: opp}",
            ],
            r"multi_agent.policies.opp.checkpoint = 'runs/old' is not valid: a random policy does not use it, "
            r"only frozen does$",
        ),
        (  # tic-tac-toe's rule against a connect-four learner: found before the run, not at its evaluations
            [
                "env.id=pettingzoo:classic.connect_four_v3",
                "multi_agent.policies={main: {}}",
                "multi_agent.self_play.enabled=true",
                "multi_agent.eval_opponents=[random, 'scripted:tictactoe']",
            ],
            r"multi_agent.eval_opponents = 'scripted:tictactoe' is not valid for env.id = "
            r"'pettingzoo:classic.connect_four_v3': on the first observation of 'player_0' ValueError: "
            r"tictactoe_scripted: observation of shape",
        ),
        (  # a rule whose move is not a legal action (a cell index of 9 on a 9-cell board)
            [
                "multi_agent.policies={main: {}, opp: {kind: scripted, rule: 'game_envs:out_of_range'}}",
                "multi_agent.policy_mapping={player_1: opp, player_2: main}",  # opp moves first: tried at reset
            ],
            r"multi_agent.policies.opp.rule = 'game_envs:out_of_range' is not valid for env.id = "
            r"'pettingzoo:classic.tictactoe_v3': on the first observation of 'player_1' it returned 9, not one of the "
            r"9 actions its mask allows",
        ),
        (
            [
                "multi_agent.policies={main: {}, opp: {kind: random}}",
                "multi_agent.self_play.enabled=true",
                "multi_agent.policy_mapping={player_1: main, player_2: opp}",
            ],
            r"self-play needs it mapped to at least two",
        ),
    ],
)
def test_a_bad_game_config_is_one_error_before_any_actor_starts(tmp_path, overrides, says):
    from rlfabric.config import ConfigError
    from rlfabric.game_driver import GameTrainer

    with pytest.raises(ConfigError, match=says):  # some found as the config loads, others by the trainer
        GameTrainer(
            load_config(None, ["algo=ppo", "env.id=pettingzoo:classic.tictactoe_v3", *overrides]), tmp_path / "run"
        )
    assert not (tmp_path / "run").exists()


def test_a_language_models_reply_becomes_a_move_only_when_legal():
    from rlfabric.policies.game_llm import parse_move

    mask = np.array([True, False, True])
    assert parse_move("move: 2", 3, mask) == 2
    assert parse_move("12", 3, mask) is None  # not an action
    assert parse_move("1", 3, mask) is None  # masked
    assert parse_move("no number", 3, None) is None
    assert parse_move(" 1x", 3, None) == 1


def test_tictactoe_as_text_shows_the_board_from_the_movers_side():
    from rlfabric.multiagent.baselines import tictactoe_text

    env = tictactoe()
    env.reset(seed=0)
    env.step(4)  # player_1 takes the centre
    env.step(0)  # player_2 takes cell 0
    obs = env.observe("player_1")
    text = tictactoe_text(obs["observation"], obs["action_mask"])
    assert text == "o..\n.x.\n...\nlegal: 1 2 3 5 6 7 8\nmove:"


@pytest.mark.parametrize(
    "field, said",
    [
        (
            "reward",
            "env 'relay' returned a non-finite reward for agent 'stay' (nan) at step 3 of an episode (env copy 0)",
        ),
        (
            "obs",
            "env 'relay' returned a non-finite observation for agent 'early' (inf) at reset (env copy 0)",
        ),
    ],
)
def test_a_nan_or_infinity_from_a_game_is_the_envs_error_naming_the_agent_and_step(field, said):
    env = broken_relay(field)
    spaces = {a: agent_spaces(env.observation_space(a), env.action_space(a), a) for a in env.possible_agents}
    copy = GameCopy(0, env, spaces, None, lambda _: dict.fromkeys(env.possible_agents, "main"), lambda _: True, "relay")
    with pytest.raises(NonFiniteEnvOutput) as raised:
        copy.reset(0)
        for _ in range(6):
            copy.apply([(r, 0, -0.7, 0) for r in copy.requests()])
    assert str(raised.value).startswith(said)


def test_agents_that_finish_early_or_join_late_have_only_their_own_steps():
    cfg = load_config(None, ["algo=ppo", "env.id=game_envs:relay", "multi_agent.critic=centralized"])
    runner = GameRunnerCore(cfg.env.id, {}, 1, 6, 0, cfg.multi_agent, 10.0)  # 6 ticks: one whole episode
    info = runner.spaces_info()["shared"]
    assert info["critic_dim"] == 3 + 3  # no state(): the 3 agents' observations, then the one-hot
    runner.set_weights(
        {"actor": ActorCritic(info["obs_dim"], info["action"], [8]).actor_arrays(), "version": 0, "obs_stats": None}
    )
    meta, frag = runner.sample()
    rows = {agent: i for i, agent in enumerate(frag.agent_id)}
    assert frag.length[rows["early"]] == 2 and frag.length[rows["stay"]] == 6 and frag.length[rows["late"]] == 3
    late = rows["late"]
    assert frag.obs[late, :3, 0].tolist() == [3.0, 4.0, 5.0]  # asked first on the step it joined
    assert frag.rewards["env"][late, :3].tolist() == [1.0, 1.0, 10.0]
    assert frag.terminated[rows["early"], :2].tolist() == [False, True]
    assert frag.loss_mask[rows["early"]].tolist() == [1, 1, 0, 0, 0, 0]  # padding past its end
    assert meta["episode_returns"] == [pytest.approx((11 + 15 + 12) / 3)]


def test_a_mapping_function_maps_agents_and_a_wrong_answer_is_named():
    assert map_agents(["player_1", "player_2"], "game_envs:by_seat", ["first", "second"]) == {
        "player_1": "first",
        "player_2": "second",
    }
    with pytest.raises(ValueError, match=r"maps agent 'player_1' to 'first', not a policy"):
        map_agents(["player_1"], "game_envs:by_seat", ["second"])


def test_a_frozen_policy_without_a_checkpoint_is_one_error(tmp_path):
    from rlfabric.config import ConfigError
    from rlfabric.game_driver import GameTrainer

    overrides = [
        "algo=ppo",
        "env.id=pettingzoo:classic.tictactoe_v3",
        "multi_agent.policies={net: {}, old: {kind: frozen, checkpoint: " + str(tmp_path / "nothing") + "}}",
        "multi_agent.policy_mapping={player_1: old, player_2: net}",
    ]
    with pytest.raises(ConfigError, match=r"multi_agent.policies.old.checkpoint = .* no run directory"):
        GameTrainer(load_config(None, overrides), tmp_path / "run")


def relay_runner(fragment_length: int, normalize: bool) -> GameRunnerCore:
    """Relay (tests/game_envs.py) in one env copy, discounted at 0.5; the policy normalizes by a mean of 2 and a
    variance of 4 (ten observations seen before) when ``normalize``."""
    cfg = load_config(None, ["algo=ppo", "env.id=game_envs:relay"])
    runner = GameRunnerCore(cfg.env.id, {}, 1, fragment_length, 0, cfg.multi_agent, 10.0, gamma=0.5)
    info = runner.spaces_info()["shared"]
    stats = {"count": 10.0, "mean": np.array([2.0]), "m2": np.array([40.0])} if normalize else None
    actor = ActorCritic(info["obs_dim"], info["action"], [8]).actor_arrays()
    runner.set_weights({"actor": actor, "version": 0, "obs_stats": stats})
    return runner


def test_a_game_normalizes_what_its_net_sees_and_reports_raw_observations_and_returns():
    _, frag = relay_runner(6, normalize=True).sample()  # one whole episode
    rows = {agent: i for i, agent in enumerate(frag.agent_id)}
    # late acts at t = 3, 4, 5: the net saw (t - 2) / 2, and the learner trains on what it saw
    np.testing.assert_allclose(frag.obs[rows["late"], :3, 0], [0.5, 1.0, 1.5])
    # the raw observations: early 0 1, stay 0..5, late 3 4 5 -> 11 values summing to 28, squares to 106
    obs_stats = frag.extras["obs_stats"]
    assert obs_stats["count"] == 11
    np.testing.assert_allclose(obs_stats["mean"], [28 / 11])
    np.testing.assert_allclose(obs_stats["m2"] / 11, [106 / 11 - (28 / 11) ** 2])
    # running discounted returns (gamma 0.5), by hand: early 1, 10.5; stay 1, 1.5, 1.75, 1.875, 1.9375, 10.96875;
    # late 1, 1.5, 10.75
    returns = [1, 10.5, 1, 1.5, 1.75, 1.875, 1.9375, 10.96875, 1, 1.5, 10.75]
    assert frag.extras["return_stats"]["count"] == 11
    np.testing.assert_allclose(frag.extras["return_stats"]["mean"], [np.mean(returns)])
    np.testing.assert_allclose(frag.extras["return_stats"]["m2"] / 11, [np.var(returns)])


def test_a_game_agents_discounted_return_carries_over_into_the_next_fragment():
    runner = relay_runner(3, normalize=False)
    _, first = runner.sample()
    _, second = runner.sample()  # stay goes on from 1.75; late starts; early has finished
    assert first.extras["return_stats"]["count"] == 5 and second.extras["return_stats"]["count"] == 6
    carried = [1.875, 1.9375, 10.96875, 1, 1.5, 10.75]  # stay's last three, then late's
    np.testing.assert_allclose(second.extras["return_stats"]["mean"], [np.mean(carried)])
    late = list(second.agent_id).index("late")
    np.testing.assert_allclose(second.obs[late, :3, 0], [3.0, 4.0, 5.0])  # no statistics: the raw observations
    _, third = runner.sample()  # a new episode: every return starts again
    np.testing.assert_allclose(third.extras["return_stats"]["mean"], [np.mean([1, 10.5, 1, 1.5, 1.75])])


def test_a_learner_merges_a_games_statistics_and_keeps_its_centralized_critics_for_resume():
    from rlfabric.actors.learner import LearnerCore

    cfg = load_config(None, ["algo=ppo", "env.id=game_envs:relay", "multi_agent.critic=centralized"])
    runner = GameRunnerCore(cfg.env.id, {}, 1, 6, 0, cfg.multi_agent, 10.0, gamma=0.5)
    info = runner.spaces_info()["shared"]
    overrides = ["ppo.normalize_obs=true", "ppo.normalize_reward=true", "ppo.minibatch_size=11"]
    config = load_config(None, ["algo=ppo", "env.id=game_envs:relay", *overrides]).to_dict()
    learner = LearnerCore(config, info["obs_dim"], info["action"], info["critic_dim"])
    runner.set_weights(learner.weights())
    _, frag = runner.sample()
    learner.update([frag])
    state = learner.state()
    assert state["obs_stats"]["count"] == 11 and state["return_stats"]["count"] == 11
    # the critic's inputs: the three agents' observations (0 where absent), then the agent's one-hot
    critic = state["critic_stats"]
    assert critic["count"] == 11
    np.testing.assert_allclose(critic["mean"][3:], [2 / 11, 6 / 11, 3 / 11])  # early, stay, late steps
    # stay's observation is t at every step (0 1, 0..5, 3 4 5): 28 in all; early's is 0 and 1 (two steps each),
    # then its last one, 2, at the 7 steps after it finished: 16 in all
    np.testing.assert_allclose(critic["mean"][:2], [16 / 11, 28 / 11])
    other = LearnerCore(config, info["obs_dim"], info["action"], info["critic_dim"])
    other.load_state(state)
    np.testing.assert_allclose(other.state()["critic_stats"]["m2"], critic["m2"])
