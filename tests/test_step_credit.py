"""Step-level credit (GiGPO, the step + trajectory mix) and the adaptive efficiency penalty: the math against
numbers worked out by hand, the per-token advantages through the batch and the learner, the config's checks, and
env state keys from real episodes into the record."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from math import sqrt

import numpy as np
import pytest
from grpo_runs import TINY

from rlfabric.actors.llm_learner import LLMLearnerCore
from rlfabric.agent_loop import EpisodeLimits, ScriptedTurns, episodes_to_trajectories, run_episodes
from rlfabric.algorithms.step_credit import (
    discounted_step_returns,
    efficiency_penalty,
    gigpo_advantages,
    step_advantages_to_tokens,
    step_group_share,
    step_mix_advantages,
)
from rlfabric.config import ConfigError, config_from_dict
from rlfabric.grpo_config import GRPOConfig
from rlfabric.llm_actors import batch_spec
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import build_char_tokenizer, build_small_model_dir, load_tokenizer
from rlfabric.models.llm_batch import grpo_batch
from rlfabric.models.sequences import keep_rows_with_advantage
from rlfabric.text_env import TextStep
from rlfabric.trajectory import TurnTokens, UniqueStep, concat, from_token_sequences, from_turns

EPS = 1e-6
S3 = 1 / sqrt(3)  # the std of rewards (1, 0, 1) (unbiased: var = (1/9 + 4/9 + 1/9) / 2 = 1/3) is 1/sqrt(3)


def keys(*values):
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


# -- the math, by hand ------------------------------------------------------------------------------------------

# Group 0: three episodes. Row 0 visits states A, B (rewards 0, 1); row 1 visits A, C (0, 0); row 2 visits A, B, D
# (0, 0, 1). Episode rewards R = (1, 0, 1). Group 1: two one-step episodes from A (rewards 1 and 0): its A is
# another task's A, and must not join group 0's.
ROWS = np.array([0, 0, 1, 1, 2, 2, 2, 3, 4])
GROUPS = np.array([0, 0, 0, 1, 1])
STEP_R = np.array([0, 1, 0, 0, 0, 0, 1, 1, 0], np.float32)
EPISODE_R = np.array([1, 0, 1, 1, 0], np.float32)
KEYS = keys("A", "B", "A", "C", "A", "B", "D", "A", "A")


def test_discounted_step_returns_by_hand():
    got = discounted_step_returns(np.array([0, 0, 0, 1, 1]), np.array([1.0, 2.0, 3.0, 4.0, 5.0]), 0.9)
    # row 0: G2 = 3, G1 = 2 + 0.9 * 3 = 4.7, G0 = 1 + 0.9 * 4.7 = 5.23; row 1: G4 = 5, G3 = 4 + 0.9 * 5 = 8.5
    np.testing.assert_allclose(got, [5.23, 4.7, 3.0, 8.5, 5.0])
    assert discounted_step_returns(np.array([0, 0]), np.array([1.0, 1.0]), 0.0).tolist() == [1.0, 1.0]


def test_gigpo_by_hand_with_repeated_and_unique_states_and_omega():
    got = gigpo_advantages(ROWS, GROUPS, STEP_R, EPISODE_R, KEYS, omega=0.5, gamma=0.5)
    # Episode advantages, group 0: R = (1, 0, 1), mean 2/3, std 1/sqrt(3) -> (1/3, -2/3, 1/3) * sqrt(3).
    # Group 1: R = (1, 0), mean 1/2, std 1/sqrt(2) -> +-1/sqrt(2).
    ae = [(1 / 3) / (S3 + EPS), (-2 / 3) / (S3 + EPS), (1 / 3) / (S3 + EPS)]
    ae1 = 0.5 / (1 / sqrt(2) + EPS)
    # Step returns at gamma 0.5: row 0 (A 0.5, B 1), row 1 (A 0, C 0), row 2 (A 0.25, B 0.5, D 1), rows 3, 4 (1, 0).
    # Step group (0, A): G = (0.5, 0, 0.25), mean 0.25, std 0.25 -> (1, -1, 0).
    # Step group (0, B): G = (1, 0.5), mean 0.75, std sqrt(0.125) -> +-0.25 / sqrt(0.125) = +-1/sqrt(2).
    # C and D: one step each -> 0. Step group (1, A): G = (1, 0), std 1/sqrt(2) -> +-1/sqrt(2).
    a_s = 0.25 / (0.25 + EPS)
    b_s = 0.25 / (sqrt(0.125) + EPS)
    g1_s = 0.5 / (1 / sqrt(2) + EPS)
    expected = [
        ae[0] + 0.5 * a_s,  # row 0, A
        ae[0] + 0.5 * b_s,  # row 0, B
        ae[1] - 0.5 * a_s,  # row 1, A
        ae[1],  # row 1, C: a state no other episode reached
        ae[2],  # row 2, A: the group's mean return from A
        ae[2] - 0.5 * b_s,  # row 2, B
        ae[2],  # row 2, D
        ae1 + 0.5 * g1_s,  # row 3, group 1's A
        -ae1 - 0.5 * g1_s,  # row 4
    ]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert got.dtype == np.float32
    # omega scales only the step term: at omega 0 every step has its episode's advantage
    np.testing.assert_allclose(
        gigpo_advantages(ROWS, GROUPS, STEP_R, EPISODE_R, KEYS, omega=0.0, gamma=0.5),
        [ae[0], ae[0], ae[1], ae[1], ae[2], ae[2], ae[2], ae1, -ae1],
        rtol=1e-5,
    )


def test_gigpo_without_std_centres_both_terms():
    got = gigpo_advantages(ROWS, GROUPS, STEP_R, EPISODE_R, KEYS, omega=1.0, gamma=0.5, scale_by_std=False)
    # A^E = R - mean: (1/3, -2/3, 1/3), (1/2, -1/2); A^S = G - mean of the step group: A (0.25, -0.25, 0),
    # B (0.25, -0.25), C and D 0, group 1's A (0.5, -0.5).
    expected = [1 / 3 + 0.25, 1 / 3 + 0.25, -2 / 3 - 0.25, -2 / 3, 1 / 3, 1 / 3 - 0.25, 1 / 3, 1.0, -1.0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


def test_equal_rewards_give_exactly_zero_advantage():
    # Eight one-step episodes of one group from the same state, each rewarded 0.1 (not exact in binary): both
    # terms must centre to exactly 0, or the learner trains rows that carry no signal (it skips rows of zeros).
    n = 8
    got = gigpo_advantages(
        np.arange(n), np.zeros(n, int), np.full(n, 0.1), np.full(n, 0.1), keys(*["A"] * n), omega=1.0
    )
    assert got.tolist() == [0.0] * n


def test_gigpo_step_term_is_zero_when_no_state_repeats():
    # One group of two episodes whose states are all different: every step group is one step.
    rows, groups = np.array([0, 0, 1]), np.array([5, 5])
    got = gigpo_advantages(
        rows, groups, np.array([0.0, 2.0, 0.0]), np.array([2.0, 0.0]), keys("x1", "x2", "y1"), omega=3.0, gamma=0.9
    )
    a = 1.0 / (sqrt(2.0) + EPS)  # R = (2, 0): mean 1, std sqrt(2)
    np.testing.assert_allclose(got, [a, a, -a], rtol=1e-6)
    assert step_group_share(rows, groups, keys("x1", "x2", "y1")) == 0.0


def test_step_group_share_by_hand():
    # group 0: A three times and B twice are shared, C and D are not; group 1's A twice is shared: 7 of 9
    assert step_group_share(ROWS, GROUPS, KEYS) == pytest.approx(7 / 9)


def test_step_mix_normalises_step_returns_over_the_whole_group():
    # One group: row 0 steps rewards (0, 1), row 1 (0, 0); gamma 0.5 -> G = (0.5, 1, 0, 0).
    rows, groups = np.array([0, 0, 1, 1]), np.array([0, 0])
    got = step_mix_advantages(
        rows, groups, np.array([0.0, 1.0, 0.0, 0.0]), np.array([1.0, 0.0]), keys("s", "s", "s", "s"),
        omega=2.0, gamma=0.5,
    )  # fmt: skip
    # A^T: mean 1.5 / 4 = 0.375, centred (0.125, 0.625, -0.375, -0.375), squares sum 0.6875, std sqrt(0.6875 / 3)
    std = sqrt(0.6875 / 3)
    a_t = [c / (std + EPS) for c in (0.125, 0.625, -0.375, -0.375)]
    a_e = 0.5 / (1 / sqrt(2) + EPS)  # R = (1, 0)
    expected = [a_e + 2 * a_t[0], a_e + 2 * a_t[1], -a_e + 2 * a_t[2], -a_e + 2 * a_t[3]]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # the same data under GiGPO: all four steps share state "s", so its step groups are the mix's group
    np.testing.assert_allclose(
        gigpo_advantages(rows, groups, np.array([0.0, 1, 0, 0]), np.array([1.0, 0]), keys("s", "s", "s", "s"),
                         omega=2.0, gamma=0.5),
        expected, rtol=1e-5,
    )  # fmt: skip


def test_step_mix_differs_from_gigpo_where_states_do_not_repeat():
    mix = step_mix_advantages(ROWS, GROUPS, STEP_R, EPISODE_R, KEYS, omega=0.5, gamma=0.5)
    # Group 1's two steps are the whole group in both: the same there.
    np.testing.assert_allclose(
        mix[7:], gigpo_advantages(ROWS, GROUPS, STEP_R, EPISODE_R, KEYS, omega=0.5, gamma=0.5)[7:]
    )
    # Row 1's step from C (G = 0) is below the group's mean step return (3.25 / 7): the mix credits it negatively,
    # GiGPO (C is reached once) gives it the episode's advantage alone.
    centred = 0.0 - 3.25 / 7
    squares = sum((g - 3.25 / 7) ** 2 for g in (0.5, 1, 0, 0, 0.25, 0.5, 1))
    expected_c = (-2 / 3) / (S3 + EPS) + 0.5 * centred / (sqrt(squares / 6) + EPS)
    assert mix[3] == pytest.approx(expected_c, rel=1e-5)


def test_efficiency_penalty_on_success_and_always_by_hand():
    counts = np.array([2, 4, 6, 10, 1, 3, 0, 0, 0, 3, 2, 6])
    success = np.array([1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1])
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3])
    # group 0: successes' counts (2, 4, 6), median 4: raw -0.4 * (0, 0, 2/4, 6/4); row 3 failed.
    # group 1: no success, median of all (1, 3, 0) = 1: raw -0.4 * (0, 2/1, 0); nobody succeeded.
    # group 2: median of (0, 0, 3) = 0, divided by max(0, 1) = 1: raw -0.4 * (0, 0, 3).
    # group 3: median of (2, 6) = 4 (mean of the middle two): raw -0.4 * (0, 2/4).
    on_success = efficiency_penalty(counts, success, groups, weight=0.4)
    np.testing.assert_allclose(on_success, [0, 0, -0.2, 0, 0, 0, 0, 0, 0, -1.2, 0, -0.2], atol=1e-7)
    always = efficiency_penalty(counts, success, groups, weight=0.4, apply="always")
    np.testing.assert_allclose(always, [0, 0, -0.2, -0.6, 0, -0.8, 0, 0, 0, -1.2, 0, -0.2], atol=1e-7)
    assert (efficiency_penalty(counts, success, groups, weight=0.0) == 0).all()
    with pytest.raises(ValueError, match="apply = 'sometimes'"):
        efficiency_penalty(counts, success, groups, weight=0.4, apply="sometimes")


def test_step_advantages_land_on_their_steps_tokens():
    spans = np.array([[0, 2, 4], [0, 7, 8], [1, 1, 4]])
    got = step_advantages_to_tokens(spans, np.array([2, 1]), np.array([0.5, -1.0, 2.0]), width=7)
    # row 0 (prompt 2): positions 2..3 -> columns 0..1, position 7 -> column 5; row 1 (prompt 1): columns 0..2
    assert got.tolist() == [[0.5, 0.5, 0, 0, 0, -1.0, 0], [2.0, 2.0, 2.0, 0, 0, 0, 0]]


def test_rows_with_any_nonzero_token_advantage_are_kept():
    import torch

    per_token = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.3, 0.0], [0.0, 0.0, 0.0]])
    assert keep_rows_with_advantage(per_token).tolist() == [False, True, False]
    assert keep_rows_with_advantage(torch.zeros(2, 3)).tolist() == [True, False]  # one row still runs
    assert keep_rows_with_advantage(torch.tensor([0.0, -1.0])).tolist() == [False, True]


# -- the record and the batch ------------------------------------------------------------------------------------


def turn(tokens, reward=0.0, key=None, calls=0.0):
    rewards = {"correct": reward, "calls": calls}
    return TurnTokens(tokens, [0.0] * len(tokens), -1, [9, 9], rewards, key)


def group_record():
    """Group 0 of the hand example (rows 0-2), each turn two tokens and a two-token reply; prompts of 2, 1, 3."""
    return from_turns(
        [[1, 2], [1], [1, 2, 3]],
        [
            [turn([5, 6], 0, "A"), turn([5, 7], 1, "B")],
            [turn([5, 6], 0, "A"), turn([6, 6], 0, "C")],
            [turn([6, 5], 0, "A"), turn([5, 7], 0, "B"), turn([7, 7], 1, "D")],
        ],
        episode_ids=[10, 11, 12],
        group_ids=[0, 0, 0],
        truncated=[False, True, False],
    )


SPEC = {"reward_weights": {"calls": 0.0}, "advantage": "grpo", "scale_by_std": True, "overlong_filter": False}


def test_turn_state_keys_reach_the_record_and_turns_without_one_get_their_own():
    record = from_turns(
        [[1], [1]],
        [[turn([5], key=("room", 3)), turn([6])], [turn([5], key=("room", 3))]],
        episode_ids=[7, 8],
        group_ids=[0, 0],
        truncated=[False, False],
    )
    assert record.state_keys.tolist() == [("room", 3), UniqueStep(7, 1), ("room", 3)]
    assert UniqueStep(7, 1) != UniqueStep(8, 1) and UniqueStep(7, 1) != "7"
    assert from_turns([[1]], [[turn([5])]], episode_ids=[0], group_ids=[0], truncated=[False]).state_keys is None
    assert record.select(np.array([False, True])).state_keys.tolist() == [("room", 3)]
    single = from_token_sequences(
        [[1]], [[5, 6]], [[0.0, 0.0]], [[0, 0]], episode_ids=[30], group_ids=[1], final_rewards={"c": [1.0]},
        truncated=[False],
    )  # fmt: skip
    both = concat([record, single])  # a part without keys gets one key per step of its own
    assert both.state_keys.tolist() == [("room", 3), UniqueStep(7, 1), ("room", 3), UniqueStep(30, 0)]
    with pytest.raises(ValueError, match=r"Trajectories.state_keys: shape \(1,\), expected \(3,\)"):
        dataclasses.replace(record, state_keys=keys("a"))


def test_grpo_batch_with_gigpo_puts_the_hand_values_on_each_steps_tokens():
    batch = grpo_batch(
        [group_record()], None, pad_id=0, **SPEC, step_credit="gigpo", step_credit_weight=0.5, step_gamma=0.5
    )
    adv = batch["advantages"]
    assert adv.shape == batch["response_mask"].shape == (3, 12)  # row 2: three turns of 2 tokens, each replied to
    ae = [(1 / 3) / (S3 + EPS), (-2 / 3) / (S3 + EPS)]
    a_s, b_s = 0.25 / (0.25 + EPS), 0.25 / (sqrt(0.125) + EPS)  # as in the hand example above
    expected = np.zeros((3, 12), np.float32)
    expected[0, 0:2], expected[0, 4:6] = ae[0] + 0.5 * a_s, ae[0] + 0.5 * b_s  # reply tokens between: 0
    expected[1, 0:2], expected[1, 4:6] = ae[1] - 0.5 * a_s, ae[1]
    expected[2, 0:2], expected[2, 4:6], expected[2, 8:10] = ae[0], ae[0] - 0.5 * b_s, ae[0]
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-7)
    assert float(batch["step_group_share"]) == pytest.approx(5 / 7)
    assert "efficiency_penalty" not in batch  # off


def test_step_credit_none_is_todays_batch_and_counts_weigh_zero_in_the_step_rewards():
    plain = grpo_batch([group_record()], None, pad_id=0, **SPEC)
    assert plain["advantages"].shape == (3,)
    np.testing.assert_allclose(plain["advantages"], [(1 / 3) / (S3 + EPS), (-2 / 3) / (S3 + EPS), (1 / 3) / (S3 + EPS)])
    record = group_record()
    record.step_rewards["calls"] = np.ones(7, np.float32)  # if counts weighed 1, every step return would change
    batch = grpo_batch([record], None, pad_id=0, **SPEC, step_credit="step_mix", step_gamma=0.5)
    same = grpo_batch([group_record()], None, pad_id=0, **SPEC, step_credit="step_mix", step_gamma=0.5)
    np.testing.assert_array_equal(batch["advantages"], same["advantages"])
    assert batch["advantages"][1, 2:4].tolist() == [0.0, 0.0]  # the reply between two turns has no advantage


def test_per_token_advantages_survive_drifted_rows_and_data_parallel_padding():
    record = group_record()
    record.tokens[1, 1] = 8  # row 1's first sampled token is not what was sampled: the trace check rejects it
    batch = grpo_batch([record], None, pad_id=0, **SPEC, step_credit="gigpo", step_gamma=0.5, world_size=4)
    assert batch["advantages"].shape == (4, 12) and int(batch["drifted_rows"]) == 1
    assert not batch["advantages"][1].any() and not batch["response_mask"][1].any()
    assert batch["advantages"][0, :2].any() and not batch["response_mask"][3].any()  # row 3 pads, without loss


def test_gigpo_without_state_keys_is_one_line_naming_the_setting():
    record = group_record()
    record.state_keys = None
    with pytest.raises(ValueError) as info:
        grpo_batch([record], None, pad_id=0, **SPEC, step_credit="gigpo")
    assert str(info.value).startswith("grpo.step_credit = 'gigpo' needs state keys") and "\n" not in str(info.value)
    assert grpo_batch([record], None, pad_id=0, **SPEC, step_credit="step_mix")["advantages"].shape == (3, 12)


def test_grpo_batch_adds_the_efficiency_penalty_before_the_advantages():
    # Two successful rows: 2 and 6 calls, median 4, so the second loses 1.0 * 2 / 4 = 0.5 of its reward of 1.
    record = from_turns(
        [[1], [1]],
        [[turn([5], 1.0, calls=2.0)], [turn([5], 1.0, calls=6.0)]],
        episode_ids=[0, 1],
        group_ids=[0, 0],
        truncated=[False, False],
    )
    efficiency = {"weight": 1.0, "counts": ["calls"], "success": "correct", "apply": "on_success"}
    spec = {**SPEC, "scale_by_std": False}
    batch = grpo_batch([record], None, pad_id=0, **spec, efficiency=efficiency)
    np.testing.assert_allclose(batch["advantages"], [0.25, -0.25])  # rewards (1, 0.5) centred
    assert float(batch["efficiency_penalty"]) == pytest.approx(-0.25)  # the rows' mean penalty
    off = grpo_batch([record], None, pad_id=0, **spec, efficiency={**efficiency, "weight": 0.0})
    assert off["advantages"].tolist() == [0.0, 0.0] and "efficiency_penalty" not in off


# -- config -----------------------------------------------------------------------------------------------------

ENV = {"env": {"id": "rlfabric/GuessNumber-v0"}, "rewards": {"functions": []}, "sft": {"steps": 0}}


def config_error(data) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"algo": "grpo", **data})
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "data, field, fragment",
    [
        ({"grpo": {"step_credit": "gigpo_v2"}}, "grpo.step_credit", "must be one of none, gigpo, step_mix"),
        ({"grpo": {"step_credit": "gigpo"}}, "grpo.step_credit", "needs a multi-turn text env (env.id)"),
        (
            {"grpo": {"step_credit": "gigpo"}, "env": {"agent": "a"}, "sft": {"steps": 0}},
            "grpo.step_credit",
            "env.agent's",
        ),
        ({**ENV, "grpo": {"step_credit": "step_mix", "advantage": "rloo"}}, "grpo.step_credit", "'grpo'"),
        ({"grpo": {"step_gamma": 1.5}}, "grpo.step_gamma", "must be in [0, 1]"),
        ({"grpo": {"step_credit_weight": -1}}, "grpo.step_credit_weight", "must be >= 0"),
        ({"rewards": {"efficiency": {"apply": "sometimes"}}}, "rewards.efficiency.apply", "'on_success', 'always'"),
        ({"rewards": {"efficiency": {"weight": -0.5, "counts": ["c"]}}}, "rewards.efficiency.weight", "must be >= 0"),
        ({"rewards": {"efficiency": {"weight": 0.5}}}, "rewards.efficiency.counts", "must name at least one"),
        ({"rewards": {"efficiency": {"counts": ["c", "correct"]}}}, "rewards.efficiency.success", "must not be one"),
    ],
)
def test_step_credit_and_efficiency_settings_out_of_range_are_one_line_naming_the_field(data, field, fragment):
    message = config_error(data)
    assert message.startswith(f"{field} = ") and "is not valid" in message and fragment in message


def test_an_unknown_efficiency_key_is_named_with_a_suggestion():
    message = config_error({"rewards": {"efficiency": {"wieght": 1.0}}})
    assert message.startswith(
        "unknown config key 'rewards.efficiency.wieght' (did you mean 'rewards.efficiency.weight'?)"
    )


def test_a_valid_config_reaches_the_learners_batch_spec_with_counts_weighing_zero():
    cfg = config_from_dict(
        {
            "algo": "grpo",
            **ENV,
            "rewards": {
                "functions": [],
                "weights": {"invalid": -1.0, "retries": -0.1},
                "efficiency": {"weight": 0.3, "counts": ["calls", "retries"], "apply": "always"},
            },
            "grpo": {"step_credit": "gigpo", "step_credit_weight": 0.5, "step_gamma": 0.9},
        }
    )
    spec = batch_spec(cfg)
    # calls is a count (0); retries is a count that rewards.weights names, so it keeps its weight
    assert spec["reward_weights"] == {"calls": 0.0, "retries": -0.1, "invalid": -1.0}
    assert (spec["step_credit"], spec["step_credit_weight"], spec["step_gamma"]) == ("gigpo", 0.5, 0.9)
    assert spec["efficiency"] == {
        "weight": 0.3,
        "counts": ["calls", "retries"],
        "success": "correct",
        "apply": "always",
    }
    default = config_from_dict({"algo": "grpo"})
    assert default.grpo.step_credit == "none" and default.rewards.efficiency.weight == 0.0
    assert batch_spec(default)["reward_weights"] == {}  # format's 0 is the arithmetic reward's, merged by the driver


def test_the_config_reference_lists_every_step_credit():
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "config.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `grpo.step_credit` |"))
    assert all(f"`{name}`" in row for name in ("none", "gigpo", "step_mix"))


# -- real episodes of an env with state_key() ---------------------------------------------------------------------


class Corridor:
    """Walk from cell 0 to cell 2: "r" moves right, anything else stays; reaching 2 is correct. Every step is one
    move ("moves": a count). ``state_key()`` is the cell; a task's "key" makes it raise, hang or return a list."""

    def reset(self, task):
        self.cell, self.key = 0, task.get("key")
        return "at 0"

    def state_key(self):
        if self.key == "raise":
            raise RuntimeError("no state")
        if self.key == "unhashable":
            return ["at", self.cell]
        return f"at{self.cell}"

    def step(self, action):
        self.cell += action == "r"
        if self.cell == 2:
            return TextStep("end", {"correct": 1.0, "moves": 1.0}, terminated=True)
        return TextStep(f"at {self.cell}", {"moves": 1.0})


class AsyncCorridor(Corridor):
    """The same, with an async state_key that can miss its deadline."""

    async def state_key(self):
        if self.key == "hang":
            await asyncio.sleep(5)
        return super().state_key()


def follow_plan(task, messages):
    """The scripted player: the task's plan, one letter per turn."""
    return task["plan"][sum(m["role"] == "assistant" for m in messages)]


def play(make_env, tasks, tokenizer, timeout_s=30.0):
    chat = ChatTokens(tokenizer)
    limits = EpisodeLimits(max_turns=3, step_timeout_s=timeout_s)
    return asyncio.run(run_episodes(make_env, tasks, ScriptedTurns(follow_plan, chat), chat, limits))


@pytest.mark.parametrize("env", [Corridor, AsyncCorridor])
def test_played_episodes_carry_the_envs_state_keys_into_the_record(env):
    episodes = play(env, [{"plan": "rr"}, {"plan": "srr"}, {"plan": "sss"}], build_char_tokenizer())
    assert [len(e.turns) for e in episodes] == [2, 3, 3] and [e.env_errors for e in episodes] == [0, 0, 0]
    record = episodes_to_trajectories(episodes, [0, 1, 2], [0, 0, 0])
    assert record.state_keys.tolist() == ["at0", "at1", "at0", "at0", "at1", "at0", "at0", "at0"]
    assert record.final_rewards["correct"].tolist() == [1.0, 1.0, 0.0]
    # GiGPO at gamma 0.5, omega 1, "moves" a count (weight 0). R = (1, 1, 0): A^E = (1/3, 1/3, -2/3) * sqrt(3).
    # Step returns: row 0 (at0 0.5, at1 1), row 1 (at0 0.25, at0 0.5, at1 1), row 2 (at0 0, 0, 0).
    # Step group at0: G = (0.5, 0.25, 0.5, 0, 0, 0), mean 5/24, centred (7, 1, 7, -5, -5, -5) / 24, squares sum
    # 174 / 576, std sqrt(174 / 576 / 5). Step group at1: G = (1, 1) -> 0.
    std = sqrt(174 / 576 / 5)
    up, mid, down = (7 / 24) / (std + EPS), (1 / 24) / (std + EPS), (-5 / 24) / (std + EPS)
    ae, ae_fail = (1 / 3) / (S3 + EPS), (-2 / 3) / (S3 + EPS)
    spec = {**SPEC, "reward_weights": {"moves": 0.0}}
    batch = grpo_batch([record], None, pad_id=0, **spec, step_credit="gigpo", step_gamma=0.5)
    expected = [ae + up, ae, ae + mid, ae + up, ae, ae_fail + down, ae_fail + down, ae_fail + down]
    spans = record.step_spans
    got = [batch["advantages"][row, start - record.prompt_length[row]] for row, start, _ in spans]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    for row, start, end in spans:  # every token of a turn has its step's value
        at = slice(start - record.prompt_length[row], end - record.prompt_length[row])
        assert len(set(batch["advantages"][row, at].tolist())) == 1


def test_a_failing_or_late_state_key_gives_the_step_a_key_of_its_own_and_the_episode_goes_on():
    tasks = [{"plan": "rr", "key": k} for k in ("raise", "hang", "unhashable", None)]
    started = time.monotonic()
    episodes = play(AsyncCorridor, tasks, build_char_tokenizer(), timeout_s=0.3)
    assert time.monotonic() - started < 3  # two missed 0.3 s deadlines, not two 5 s sleeps
    assert all(e.error is None and e.rewards["correct"] == 1.0 for e in episodes)
    assert [e.env_errors for e in episodes] == [2, 2, 2, 0] == [e.state_key_errors for e in episodes]
    record = episodes_to_trajectories(episodes, [40, 41, 42, 43], [0, 0, 0, 0])
    assert record.state_keys.tolist() == [
        UniqueStep(40, 0), UniqueStep(40, 1), UniqueStep(41, 0), UniqueStep(41, 1),
        UniqueStep(42, 0), UniqueStep(42, 1), "at0", "at1",
    ]  # fmt: skip


def test_the_learner_trains_on_per_token_step_advantages_and_skips_rows_without_any(tmp_path):
    model_dir = build_small_model_dir(tmp_path / "m", **{**TINY, "max_positions": 256})
    tokenizer = load_tokenizer(model_dir)
    group0 = episodes_to_trajectories(
        play(Corridor, [{"plan": "rr"}, {"plan": "srr"}, {"plan": "sss"}], tokenizer), [0, 1, 2], [0, 0, 0]
    )
    # group 1: two identical episodes, so every step advantage is 0 and both rows are skipped
    group1 = episodes_to_trajectories(play(Corridor, [{"plan": "rr"}] * 2, tokenizer), [3, 4], [1, 1])
    spec = {
        **SPEC,
        "reward_weights": {"moves": 0.0},
        "step_credit": "gigpo",
        "step_gamma": 0.5,
        # group 0's moves (2, 3, 3), successes (2, 3): median 2.5, row 1 loses 1.0 * 0.5 / 2.5 = 0.2
        "efficiency": {"weight": 1.0, "counts": ["moves"], "success": "correct", "apply": "on_success"},
    }
    config = {**dataclasses.asdict(GRPOConfig()), "norm_length": 6, "micro_batch_size": 2}
    learner = LLMLearnerCore(str(model_dir), config, {"lr": 1e-3}, temperature=1.0, batch_spec=spec)
    batch = learner.batch_from([group0, group1], None)
    assert batch["advantages"].shape == batch["response_mask"].shape
    metrics = learner.train_on([group0, group1], None, lr=1e-3)
    assert (metrics["trained_rows"], metrics["skipped_rows"]) == (3, 2)
    assert metrics["efficiency_penalty"] == pytest.approx(-0.2 / 5)
    assert metrics["step_group_share"] == 1.0  # every cell was reached by another episode of its group
    # one on-policy pass: the ratio is 1, so the token-mean loss is -sum(A * mask) / sum(mask) over the batch
    mask = batch["response_mask"]
    assert metrics["pg_loss"] == pytest.approx(-(batch["advantages"] * mask).sum() / mask.sum(), rel=1e-5)
