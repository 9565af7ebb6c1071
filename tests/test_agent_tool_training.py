"""The shipped tool-use example learns end to end: examples/agent_tool_grpo.yaml, shortened, raises held-out
success on KeyLookup from nothing, through a warm-up on scripted episodes that call the lookup tool and a few
GRPO steps on the policy's own episodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlfabric.config import config_from_dict
from rlfabric.llm_driver import train_llm
from rlfabric.run.log import read_metrics

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "agent_tool_grpo.yaml"


@pytest.mark.slow
def test_the_tool_use_example_raises_held_out_success(local_ray, tmp_path):
    config = yaml.safe_load(EXAMPLE.read_text())
    # Shortened: the perfect player (every demonstration calls the tool), fewer warm-up steps and tasks, and
    # three GRPO steps, enough to show the policy's own episodes use the tool and get rewarded.
    config["data"].update(num_train=400, num_eval=20)
    config["sft"].update(steps=450, player="rlfabric.envs.key_lookup:lookup_player")
    config["grpo"].update(prompts_per_step=8)
    config["training"].update(total_steps=3, eval_every=0, show_samples=0)
    summary = train_llm(config_from_dict(config), tmp_path, quiet=True)
    evals = {r["label"]: r["eval_accuracy"] for r in read_metrics(tmp_path) if r.get("phase") == "eval"}
    assert evals["initial"] <= 0.05  # the untrained model cannot spell a call, let alone guess a hidden value
    assert evals["after_sft"] >= 0.6 and evals["final"] >= 0.6, evals
    grpo = [r for r in read_metrics(tmp_path) if r.get("phase") == "grpo"]
    assert len(grpo) == 3 and summary["failed_samples"] == 0
    assert all(r["tool_calls"] >= 0.8 * 8 * 8 and r["reward_correct"] > 0.5 for r in grpo), grpo
