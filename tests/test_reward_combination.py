"""Combining reward components (``rewards.combine``): the weighted sum, clipping, gating and MO-GRPO's
per-component group normalization, each against values computed by hand."""

from __future__ import annotations

import re

import numpy as np
import pytest

from rlfabric.algorithms.reward_combination import combine_rewards

# Two groups: rows 0-2 from one prompt, rows 3-4 from another.
GROUPS = np.array([0, 0, 0, 1, 1])
COMPONENTS = {
    "correct": np.array([1.0, 0.0, 1.0, 0.0, 0.0]),
    "length": np.array([-3.0, -1.0, -2.0, -1.0, -5.0]),
}
WEIGHTS = {"correct": 1.0, "length": 0.5}


def test_the_weighted_sum_counts_unnamed_components_with_weight_one_and_skips_weight_zero():
    assert combine_rewards(COMPONENTS, GROUPS, WEIGHTS).tolist() == [-0.5, -0.5, 0.0, -0.5, -2.5]
    assert combine_rewards(COMPONENTS, GROUPS, {}).tolist() == [-2.0, -1.0, -1.0, -1.0, -5.0]
    assert combine_rewards(COMPONENTS, GROUPS, {"length": 0.0}).tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]


def test_mo_grpo_normalizes_each_component_within_its_group_before_the_sum():
    # group 0, correct [1, 0, 1]: mean 2/3, unbiased std sqrt(1/3) -> [0.57735, -1.15470, 0.57735]
    #          length [-3, -1, -2]: mean -2, std 1 -> [-1, 1, 0], times 0.5
    # group 1, correct [0, 0]: constant, contributes 0; length [-1, -5]: mean -3, std sqrt(8) -> [0.70711, -0.70711]
    expected = [0.57735 - 0.5, -1.15470 + 0.5, 0.57735, 0.5 * 0.70711, -0.5 * 0.70711]
    got = combine_rewards(COMPONENTS, GROUPS, WEIGHTS, normalize=True)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_a_component_with_a_wide_spread_no_longer_decides_the_ranking_once_normalized():
    groups = np.zeros(4, np.int64)
    parts = {"correct": np.array([1.0, 1.0, 0.0, 0.0]), "brevity": np.array([-40.0, -10.0, -12.0, -8.0])}
    plain = combine_rewards(parts, groups, {})
    normalized = combine_rewards(parts, groups, {}, normalize=True)
    assert plain.argmax() == 3  # the shortest wrong answer beats the correct ones in the plain sum
    assert normalized.argmax() == 1  # correct and short


def test_gating_zeroes_a_component_where_its_gate_fails_and_a_missing_gate_fails_everywhere():
    parts = {**COMPONENTS, "efficiency": np.array([-1.0, -1.0, 0.0, -2.0, 0.0])}
    gated = combine_rewards(parts, GROUPS, {"correct": 0.0, "length": 0.0}, gates={"efficiency": "correct"})
    assert gated.tolist() == [-1.0, 0.0, 0.0, 0.0, 0.0]
    nowhere = combine_rewards(parts, GROUPS, {"correct": 0.0, "length": 0.0}, gates={"efficiency": "judge"})
    assert nowhere.tolist() == [0.0] * 5


def test_clipping_comes_first_and_gates_read_the_clipped_values():
    clipped = combine_rewards(COMPONENTS, GROUPS, {"correct": 0.0}, clip={"length": (-2.0, 0.0)})
    assert clipped.tolist() == [-2.0, -1.0, -2.0, -1.0, -2.0]
    parts = {"score": np.array([0.3, -0.4, 0.9]), "bonus": np.array([1.0, 1.0, 1.0])}
    got = combine_rewards(parts, np.zeros(3), {"score": 0.0}, clip={"score": (0.0, 1.0)}, gates={"bonus": "score"})
    assert got.tolist() == [1.0, 0.0, 1.0]  # -0.4 clipped to 0 fails the gate


@pytest.mark.parametrize("normalize", [False, True])
def test_no_rows_give_no_rewards(normalize):
    empty = {"correct": np.zeros(0)}
    assert combine_rewards(empty, np.zeros(0, np.int64), {}, normalize=normalize).shape == (0,)


def test_the_learners_batch_takes_its_advantages_from_the_combined_reward():
    from rlfabric.models.llm_batch import grpo_batch
    from rlfabric.trajectory import from_token_sequences

    record = from_token_sequences(
        [[1, 2]] * 3,
        [[5, 6]] * 3,
        [[0.0, 0.0]] * 3,
        [[0, 0]] * 3,
        episode_ids=[0, 1, 2],
        group_ids=[0, 0, 0],
        final_rewards={"correct": [1.0, 0.0, 1.0], "length": [-3.0, -1.0, -2.0]},
        truncated=[False] * 3,
    )
    spec = {"pad_id": 0, "reward_weights": {"length": 0.5}, "advantage": "grpo", "scale_by_std": False}
    plain = grpo_batch([record], None, **spec, overlong_filter=False)
    # rewards 1 - 1.5, 0 - 0.5, 1 - 1 = (-0.5, -0.5, 0), centred on their mean -1/3
    np.testing.assert_allclose(plain["advantages"], [-1 / 6, -1 / 6, 1 / 3], atol=1e-6)
    normalized = grpo_batch([record], None, **spec, overlong_filter=False, combine={"normalize": True})
    # the hand-computed MO-GRPO rewards of the first test's group 0, whose mean is 0
    np.testing.assert_allclose(normalized["advantages"], [0.57735 - 0.5, -1.15470 + 0.5, 0.57735], atol=1e-5)
    gated = grpo_batch([record], None, **spec, overlong_filter=False, combine={"gates": {"length": "correct"}})
    # length counts only where correct: (1 - 1.5, 0, 1 - 1) = (-0.5, 0, 0), mean -1/6
    np.testing.assert_allclose(gated["advantages"], [-1 / 3, 1 / 6, 1 / 6], atol=1e-6)


def test_component_names_no_reward_gave_are_named_by_field_and_misspellings_get_the_name_they_resemble():
    from rlfabric.config import config_from_dict
    from rlfabric.reward_names import misspelling_note, names_by_field, unknown_components

    rewards = config_from_dict(
        {
            "rewards": {
                "weights": {"formt": 0.0, "corect": 2.0, "length": 0.5, "penalty": -1.0},
                "combine": {"clip": {"lenght": [-1, 0]}, "gates": {"length": "corect"}},
                "efficiency": {"weight": 0.1, "counts": ["tool_calls"], "success": "correct"},
                "shadow": {"functions": [{"name": "arithmetic"}], "train_component": "correct"},
            }
        }
    ).rewards
    given = {"correct", "format", "length", "tool_calls"}
    unknown = unknown_components(rewards.component_references(), given)
    assert unknown == [
        ("rewards.weights", "formt"),  # a zero weight too: misspelt, the component meant keeps its weight
        ("rewards.weights", "corect"),
        ("rewards.weights", "penalty"),
        ("rewards.combine.clip", "lenght"),
        ("rewards.combine.gates", "corect"),
    ]
    assert names_by_field(unknown) == (
        "rewards.weights names 'formt', 'corect', 'penalty'; rewards.combine.clip names 'lenght'; "
        "rewards.combine.gates names 'corect'"
    )
    assert misspelling_note(rewards.component_references(), given) == (
        "rewards.weights names 'formt' (did you mean 'format'?), 'corect' (did you mean 'correct'?); "
        "rewards.combine.clip names 'lenght' (did you mean "
        "'length'?); rewards.combine.gates names 'corect' (did you mean 'correct'?): no reward gave such a "
        "component at the first scored step"
    )
    assert unknown_components(rewards.component_references(), given | {"formt", "corect", "lenght", "penalty"}) == []
    assert misspelling_note([("rewards.weights", "penalty")], given) is None  # resembles no given name
    assert ("rewards.shadow.train_component", "correct") in rewards.component_references()
    # the default weights name nothing; an efficiency penalty that is off, and shadow verifiers that are off, name
    # nothing
    assert config_from_dict({}).rewards.component_references() == []
    off = config_from_dict({"rewards": {"efficiency": {"counts": ["calls"], "success": "won"}}}).rewards
    assert off.component_references() == []


@pytest.mark.parametrize(
    ("rewards", "says"),
    [
        (
            {"weights": {"corect": 1.0}},
            "rewards.weights names 'corect' (did you mean 'correct'?): the run's reward set gives only correct, format "
            "(rlfabric rewards list shows what each gives)",
        ),
        (
            {"combine": {"gates": {"format": "corect"}}},
            "rewards.combine.gates names 'corect' (did you mean 'correct'?)",
        ),
    ],
)
def test_a_name_no_declared_reward_gives_is_refused_before_any_actor_starts(no_ray, tmp_path, rewards, says):
    """Every function declares its components (the arithmetic reward: correct, format), so a misspelt name is one
    line at construction; it was a note at the first scored step, after Ray, the evaluation and a step ran."""
    import ray
    from grpo_runs import BASE, merged

    from rlfabric.config import ConfigError, config_from_dict
    from rlfabric.llm_driver import GRPOTrainer

    with pytest.raises(ConfigError, match=re.escape(says)):
        GRPOTrainer(config_from_dict(merged(BASE, {"rewards": rewards})), tmp_path / "run")
    assert not ray.is_initialized() and not (tmp_path / "run").exists()


def test_several_components_summed_at_a_weight_nobody_gave_them_are_said_once():
    from rlfabric.config import config_from_dict
    from rlfabric.reward_watch import RewardWatch

    def watch(weights: dict[str, float]) -> list[str]:
        said: list[str] = []
        cfg = config_from_dict({"rewards": {"weights": weights}})
        w = RewardWatch(cfg, cfg.rewards.component_references(), said.append)
        for _ in range(3):  # steps: said at the first only
            w.after_step([{"rows": 8, "component_means": {"score": 0.5, "acc": 0.5, "format": 1.0}}], set())
        return said

    assert watch({"format": 0.1}) == [
        "the reward trained on is the sum of 'acc', 'score', each at weight 1 (rewards.weights names none of them); "
        "give a component that only describes a sample weight 0 in rewards.weights (e.g. 'rewards.weights={acc: "
        "0}') to log it without rewarding it"
    ]
    assert watch({"acc": 0.0, "format": 0.1}) == []  # one component left at the implicit weight: it is the reward
