"""End-to-end GRPO on CPU raises the reward: generators, reward actors, learner and weight sync together."""

from __future__ import annotations

import numpy as np

from rlfabric.config import config_from_dict
from rlfabric.llm_driver import train_llm
from rlfabric.rewards import RewardInput, register_reward
from rlfabric.run.log import read_metrics


def digit_share(inputs: list[RewardInput]) -> list[dict[str, float]]:
    """A dense reward an untrained model can climb: the share of digits among the generated characters."""
    return [{"digits": sum(ch.isdigit() for ch in s.completion) / 8.0} for s in inputs]


register_reward("test-digit-share", digit_share)


def test_short_grpo_run_raises_the_reward(local_ray, tmp_path):
    cfg = config_from_dict(
        {
            "model": {"builtin": {"num_layers": 1, "hidden_size": 64, "num_heads": 2}},
            "data": {"train": "task:arithmetic?max_operand=9", "num_train": 200, "num_eval": 8},
            "sampling": {"max_new_tokens": 8},
            "rewards": {"functions": [{"name": "test-digit-share"}], "num_cpus": 0.25},
            "grpo": {"prompts_per_step": 8, "group_size": 8, "lr": 3e-3},
            "sft": {"steps": 0},
            "training": {"total_steps": 20, "eval_every": 0, "checkpoint_every": 0},
        }
    )
    summary = train_llm(cfg, tmp_path, quiet=True)
    rows = [r for r in read_metrics(tmp_path) if r.get("phase") == "grpo"]
    rewards = [r["reward_mean"] for r in rows]
    assert len(rewards) == 20 and summary["failed_samples"] == 0
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > first + 0.25, rewards
    assert all(r["policy_version"] == i + 1 for i, r in enumerate(rows))  # one weight version per step
