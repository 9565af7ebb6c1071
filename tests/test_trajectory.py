"""The trajectory record: construction checks, selection, concatenation, the object store, and both learners."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from rlfabric.models.llm_batch import grpo_batch
from rlfabric.models.packed_batch import pack_trajectories
from rlfabric.trajectory import NO_VERSION, concat, from_time_major, from_token_sequences, time_major


def two_groups():
    """Group 7: two samples of prompt [5, 6]; group 8: one sample of prompt [9] (hand-written numbers)."""
    return from_token_sequences(
        prompts=[[5, 6], [5, 6], [9]],
        responses=[[1, 2, 3], [4], [7, 8]],
        logprobs=[[-0.1, -0.2, -0.3], [-0.4], [-0.5, -0.6]],
        versions=[[3, 3, 3], [4], [4, 4]],
        episode_ids=[70, 71, 80],
        group_ids=[7, 7, 8],
        final_rewards={"correct": [1.0, 0.0, 1.0], "format": [0.5, 0.5, 0.0]},
        truncated=[False, True, False],
    )


def test_token_sequences_lay_out_prompt_then_response_with_mask_versions_and_spans():
    t = two_groups()
    assert t.num_rows == 3 and t.width == 5
    assert t.tokens.tolist() == [[5, 6, 1, 2, 3], [5, 6, 4, 0, 0], [9, 7, 8, 0, 0]]
    assert t.length.tolist() == [5, 3, 3] and t.prompt_length.tolist() == [2, 2, 1]
    assert t.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0, 1, 1, 0, 0]]
    assert t.policy_version.tolist() == [[-1, -1, 3, 3, 3], [-1, -1, 4, -1, -1], [-1, 4, 4, -1, -1]]
    assert NO_VERSION == -1
    np.testing.assert_allclose(t.logprobs[0], [0, 0, -0.1, -0.2, -0.3], rtol=1e-6)
    assert t.step_spans.tolist() == [[0, 2, 5], [1, 2, 3], [2, 1, 3]]
    assert t.truncated.tolist()[1] == [False, False, True, False, False]
    assert t.terminated[0, 4] and not t.terminated[1].any()
    # r = 1.0 * correct + 0.2 * format (weights given) ; unlisted components weigh 1
    np.testing.assert_allclose(t.total_reward({"format": 0.2}), [1.1, 0.1, 1.0], rtol=1e-6)
    np.testing.assert_allclose(t.total_reward({}), [1.5, 0.5, 1.0], rtol=1e-6)


def test_a_column_of_the_wrong_shape_is_named():
    t = two_groups()
    with pytest.raises(ValueError, match=r"Trajectories.final_rewards\['x'\]: shape \(2,\)"):
        type(t)(**{**t.__dict__, "final_rewards": {"x": np.zeros(2, np.float32)}})
    with pytest.raises(ValueError, match=r"Trajectories.policy_version: shape \(3, 4\)"):
        type(t)(**{**t.__dict__, "policy_version": np.zeros((3, 4), np.int32)})


def test_select_and_concat_keep_rows_spans_and_rewards_together():
    t = two_groups()
    picked = t.select(np.array([False, True, True]))
    assert picked.episode_id.tolist() == [71, 80]
    assert picked.step_spans.tolist() == [[0, 2, 3], [1, 1, 3]]  # renumbered rows
    assert picked.final_rewards["correct"].tolist() == [0.0, 1.0]
    wide = from_token_sequences(
        [[1]], [[2, 3, 4, 5, 6, 7]], [[0.0] * 6], [[9] * 6],
        episode_ids=[90], group_ids=[9], final_rewards={"correct": [0.0], "format": [1.0]}, truncated=[True],
    )  # fmt: skip
    both = concat([picked, wide])
    assert both.width == 7 and both.num_rows == 3
    assert both.tokens[0].tolist() == [5, 6, 4, 0, 0, 0, 0]  # re-padded to the widest
    assert both.step_spans.tolist() == [[0, 2, 3], [1, 1, 3], [2, 1, 7]]  # the second part's rows shifted
    assert both.group_id.tolist() == [7, 8, 9]


def test_the_record_round_trips_through_the_object_store(local_ray):
    t = two_groups()
    back = ray.get(ray.put(t))
    assert back.tokens.tolist() == t.tokens.tolist()
    assert back.final_rewards["format"].tolist() == t.final_rewards["format"].tolist()
    assert back.agent_id.tolist() == ["agent_0"] * 3 and back.policy_id.tolist() == ["default"] * 3
    assert back.nbytes() == t.nbytes() > 0


def test_grpo_batch_packs_chosen_groups_with_group_advantages():
    t = two_groups()
    batch = grpo_batch(
        [t],
        [7],
        pad_id=0,
        reward_weights={"format": 0.0},
        advantage="rloo",
        scale_by_std=True,
        overlong_filter=True,
        world_size=4,
    )
    # group 7 only: prompts [5, 6] (left-padded to 2), responses [1, 2, 3] and [4]; two copies pad to 4 rows
    assert batch["input_ids"][:2].tolist() == [[5, 6, 1, 2, 3], [5, 6, 4, 0, 0]]
    assert int(batch["prompt_len"]) == 2
    # RLOO: A_i = r_i - mean of the others' rewards: 1 - 0 = 1 and 0 - 1 = -1
    assert batch["advantages"][:2].tolist() == [1.0, -1.0]
    # overlong filter: the truncated row trains on nothing; padding rows neither
    assert batch["response_mask"].tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    np.testing.assert_allclose(batch["behaviour_logprobs"][0], [-0.1, -0.2, -0.3], rtol=1e-6)


def test_pack_trajectories_trains_only_where_the_loss_mask_is_one():
    t = two_groups()
    t.loss_mask[0, 3] = 0.0  # e.g. a tool token inside the completion
    batch = pack_trajectories(t, pad_id=0)
    assert batch["response_mask"][0].tolist() == [1, 0, 1]


def test_a_time_major_fragment_becomes_rows_per_env_and_back():
    steps, envs, dim = 3, 2, 4
    obs = np.arange(steps * envs * dim, dtype=np.float32).reshape(steps, envs, dim)
    rewards = np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    done = np.zeros((steps, envs), bool)
    t = from_time_major(
        obs=obs,
        actions=np.array([[0, 1], [1, 1], [0, 0]]),
        logprobs=np.full((steps, envs), -0.7, np.float32),
        rewards=rewards,
        terminated=done,
        truncated=done,
        version=5,
        bootstrap_obs=np.zeros((envs, dim), np.float32),
        truncation_index=np.array([[1, 0]]),  # (t=1, env 0)
        truncation_obs=np.ones((1, dim), np.float32),
    )
    assert t.num_rows == envs and t.width == steps
    assert t.rewards["env"].tolist() == [[1, 3, 5], [2, 4, 6]]
    assert t.truncation_index.tolist() == [[0, 1]]  # (row, position)
    assert (t.policy_version == 5).all() and (t.loss_mask == 1).all()
    np.testing.assert_array_equal(time_major(t.obs), obs)


def test_group_statistics_are_what_the_driver_chooses_groups_by():
    from rlfabric.actors.rollout_meta import group_statistics

    group_ids = np.array([3, 3, 4, 4, 5])
    rewards = np.array([1.0, 0.0, 1.0, 1.0, 2.0], np.float32)
    versions = np.array([2, 3, 4, 4, 1])
    stats = group_statistics(group_ids, rewards, versions, [3, 4, 5, 6])
    # id, mean reward, rewards differ, rows, oldest version; group 6 lost every row (its scoring failed)
    assert stats[:3].tolist() == [[3, 0.5, 1, 2, 2], [4, 1.0, 0, 2, 4], [5, 2.0, 0, 1, 1]]
    assert stats[3, 0] == 6 and np.isnan(stats[3, 1]) and stats[3, 2:].tolist() == [0, 0, -1]
    assert stats.dtype == np.float32


def test_concat_fills_a_reward_component_a_part_lacks_with_zeros():
    """Two rollouts where only one earned 'correct' (a multi-turn env gives components as they happen)."""
    first = from_token_sequences(
        [[1]],
        [[2, 3]],
        [[-0.1, -0.2]],
        [[0, 0]],
        episode_ids=[0],
        group_ids=[0],
        final_rewards={"correct": [1.0], "invalid": [0.0]},
        truncated=[False],
    )
    second = from_token_sequences(
        [[4]],
        [[5]],
        [[-0.3]],
        [[0]],
        episode_ids=[1],
        group_ids=[1],
        final_rewards={"invalid": [2.0]},
        truncated=[False],
    )
    both = concat([first, second])
    np.testing.assert_array_equal(both.final_rewards["correct"], [1.0, 0.0])
    np.testing.assert_array_equal(both.final_rewards["invalid"], [0.0, 2.0])
