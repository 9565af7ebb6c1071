"""Shadow verifiers (``rewards.shadow``): a second reward beside the training one on a share of the groups,
never used for learning, its disagreement with the training reward logged; the counts by hand, a shadow that
disagrees on purpose in a real run, and a bad shadow spec refused before any actor starts."""

from __future__ import annotations

import numpy as np
import pytest
from grpo_runs import BASE, merged, run_grpo, write_prompts

from rlfabric.config import ConfigError, config_from_dict
from rlfabric.llm_driver import GRPOTrainer
from rlfabric.rewards import RewardInput, register_reward
from rlfabric.rewards.shadow import sampled_groups, shadow_rates, verdict_counts


def test_verdict_counts_and_rates_by_hand():
    train = np.array([True, True, False, False, True])
    shadow = np.array([True, False, True, False, False])
    counts = verdict_counts(train, shadow)
    assert counts == {"shadow_samples": 5, "shadow_disagree": 3, "shadow_false_positive": 2, "shadow_false_negative": 1}
    assert shadow_rates(counts) == {
        "shadow_samples": 5.0,
        "shadow_disagreement": 0.6,
        "shadow_false_positive": 0.4,
        "shadow_false_negative": 0.2,
    }
    assert shadow_rates(verdict_counts(np.zeros(0, bool), np.zeros(0, bool))) == {}
    assert len(sampled_groups(8, 0.25, seed=3)) == 2 and sampled_groups(8, 0.25, 3) == sampled_groups(8, 0.25, 3)
    assert sampled_groups(3, 0.5, seed=0) != [] and len(sampled_groups(3, 0.5, 0)) == 2  # ceil


def contrarian(inputs: list[RewardInput]) -> list[dict[str, float]]:
    """Says the opposite of the exact-sum verifier on every sample."""
    return [{"correct": 1.0 - float(s.completion.strip().split("\n")[0] == s.metadata["answer"])} for s in inputs]


register_reward("contrarian", contrarian)


def test_a_shadow_that_always_disagrees_shows_it_on_the_sampled_share_and_trains_nothing(tmp_path, local_ray):
    prompts = write_prompts(tmp_path / "p.jsonl", [f"{a}+{b}=" for a in range(0, 10, 2) for b in range(10)])
    shadow = {"functions": [{"name": "contrarian"}], "sample": 0.5}
    run = run_grpo(
        tmp_path / "run",
        data={"train": prompts, "eval": prompts, "num_train": 40, "num_eval": 8},
        rewards={"shadow": shadow},
        training={"total_steps": 3},
    )
    rows = run.phase("grpo")
    assert len(rows) == 3
    for row in rows:
        assert row["shadow_samples"] == 4  # one of each step's two groups of 4
        assert row["shadow_disagreement"] == 1.0
        assert row["shadow_false_positive"] + row["shadow_false_negative"] == 1.0
        components = {k for k in row if k.startswith("reward_")} - {
            "reward_mean",
            "reward_time_s",
            "reward_worker_restarts",
        }
        assert components == {"reward_correct", "reward_format"}  # the shadow's verdicts are not rewards


def test_a_bad_shadow_spec_is_refused_before_any_actor_starts(tmp_path):
    cfg = config_from_dict(merged(BASE, {"rewards": {"shadow": {"functions": [{"name": "no_such_reward"}]}}}))
    with pytest.raises(ConfigError, match=r"^rewards.shadow.functions\[0\] = 'no_such_reward' is not valid"):
        GRPOTrainer(cfg, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^rewards.shadow.sample = 0.0 is not valid: must be in \(0, 1\]"):
        config_from_dict(merged(BASE, {"rewards": {"shadow": {"functions": [{"name": "arithmetic"}], "sample": 0.0}}}))
