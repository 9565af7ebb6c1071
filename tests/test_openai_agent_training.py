"""GRPO on outside agents chosen in a run's config (``env.agent``): agent functions written against the ``openai``
client play the episodes through the endpoint, their exact segments are trained on, rewritten histories and bad
agents are counted in the metrics, and settings that cannot work stop before any actor starts."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from grpo_runs import BASE, merged, run_grpo

from rlfabric.actor_slots import RunAbortedError
from rlfabric.actors.rollout_meta import last_row_of_each_episode
from rlfabric.agents import register_agent
from rlfabric.config import ConfigError, config_from_dict
from rlfabric.llm_driver import GRPOTrainer, train_llm
from rlfabric.run.log import read_metrics

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

AGENT_RUN = {
    "model": {"builtin": {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "max_positions": 256}},
    "data": {"train": "task:key_lookup", "num_train": 16, "num_eval": 4},
    "env": {"agent": "tests-chatty"},
    "rewards": {"functions": []},
    "sampling": {"max_new_tokens": 6},
    "training": {"total_steps": 2, "eval_every": 0, "show_samples": 2},
}


EPISODES = itertools.count()  # the agent's episodes in the worker, in the order they start (deterministic)


async def chatty(task, client):
    """Two calls. Every fourth episode raises before calling; every other one sends its second call with the
    first exchange dropped (a rewritten history: a second exact segment). Reward: whether the answer's length is
    even, which a random policy gets about half the time (signal in most groups)."""
    episode = next(EPISODES)
    if episode % 4 == 0:
        raise ValueError(f"no luck with episode {episode}")
    opening = [{"role": "user", "content": f"Value of key {task['key']}?"}]
    first = await client.chat.completions.create(model="policy", messages=opening)
    history = [*opening, first.choices[0].message.model_dump(exclude_none=True)]
    follow = {"role": "user", "content": "again"}
    messages = [follow] if episode % 2 else [*history, follow]
    second = await client.chat.completions.create(model="policy", messages=messages)
    return {"correct": float(len(second.choices[0].message.content or "") % 2 == 0)}


def test_grpo_trains_on_an_openai_client_agent_and_counts_rewrites_and_failures(local_ray, tmp_path):
    register_agent("tests-chatty", chatty)  # a test module: the agent travels to the worker by value
    run = run_grpo(tmp_path / "run", **AGENT_RUN)
    steps = run.phase("grpo")
    assert len(steps) == 2 and sum(r["trained_rows"] for r in steps) > 0
    for r in steps:
        assert r["turns_mean"] == 1.5  # two calls an episode, none in the quarter whose agent raised
        assert r["rewrites"] == 2 * 4 / 2 and r["refused_unauthorized"] == 0 and r["refused_bad_request"] == 0
    assert 0 < run.summary["failed_samples"] == steps[-1]["failed_samples"]  # the raising tasks, recorded
    evals = run.phase("eval")
    assert [e["label"] for e in evals] == ["initial", "final"]


async def always_raises(task, client):
    raise RuntimeError("agent bug")


def test_the_last_row_of_each_episode_counts_it_once():
    # episode 3 rewrote its history once (two rows), episode 7 twice (three rows)
    assert last_row_of_each_episode(np.array([3, 3, 5, 7, 7, 7])).tolist() == [1, 2, 5]
    assert last_row_of_each_episode(np.array([], np.int64)).tolist() == []


def test_an_agent_that_fails_every_episode_stops_the_run_with_its_error(local_ray, tmp_path):
    register_agent("tests-always-raises", always_raises)
    with pytest.raises(RunAbortedError, match="failed its episode: the agent raised RuntimeError: agent bug"):
        run_grpo(tmp_path / "run", **{**AGENT_RUN, "env": {"agent": "tests-always-raises"}})


def trainer(tmp_path, **changes):
    return GRPOTrainer(config_from_dict(merged(merged(BASE, AGENT_RUN), changes)), tmp_path / "run", quiet=True)


@pytest.mark.parametrize(
    "agent, says",
    [
        (
            "no_such_module:run",
            "'no_such_module:run' is not valid: no module 'no_such_module' in the current directory",
        ),
        ("json:no_such_agent", "'json:no_such_agent' is not valid: module 'json' has no function 'no_such_agent'"),
        ("no_such_agent", "'no_such_agent': not a registered agent"),
    ],
)
def test_an_agent_that_names_nothing_stops_setup_before_ray_saying_why(tmp_path, agent, says):
    t = trainer(tmp_path, env={"agent": agent})
    with pytest.raises(ConfigError) as info:
        t.setup()
    assert str(info.value).startswith(f"env.agent = {says}"), info.value
    assert t.generators is None and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"env": {"agent": "x", "id": "rlfabric/GuessNumber-v0"}}, "env.agent = 'x' is not valid: is exclusive"),
        ({"sft": {"steps": 10}}, "sft.steps = 10 is not valid: needs sft.player with env.agent"),
        ({"env": {"tool_servers": ["notes"]}}, "env.tool_servers = \\['notes'\\] is not valid: needs env.id"),
        ({"env": {"agent_timeout_s": 0}}, "env.agent_timeout_s = 0.0 is not valid: must be > 0"),
    ],
)
def test_agent_settings_that_cannot_work_are_one_line_config_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(merged(merged(BASE, AGENT_RUN), changes))


def test_an_unknown_tool_parser_is_named_before_ray(tmp_path):
    register_agent("tests-chatty", chatty)
    t = trainer(tmp_path, env={"tool_parser": "xml"})
    with pytest.raises(ConfigError, match="env.tool_parser = 'xml' is not valid: expected one of hermes"):
        t.setup()
    assert t.generators is None


@pytest.mark.slow
def test_the_openai_agent_example_raises_held_out_success(local_ray, tmp_path):
    """examples/openai_agent_grpo.yaml, shortened: the agent's own episodes with the perfect player answering are
    the warm-up, and a few GRPO steps on the policy's episodes through the endpoint use the agent's tool."""
    import yaml

    config = yaml.safe_load((EXAMPLES / "openai_agent_grpo.yaml").read_text())
    config["data"].update(num_train=400, num_eval=20)
    config["sft"].update(steps=450, demonstrations=400, player="rlfabric.envs.lookup_agent:lookup_player")
    config["grpo"].update(prompts_per_step=8)
    config["training"].update(total_steps=3, eval_every=0, show_samples=0)
    summary = train_llm(config_from_dict(config), tmp_path, quiet=True)
    rows = read_metrics(tmp_path)
    evals = {r["label"]: r["eval_accuracy"] for r in rows if r.get("phase") == "eval"}
    assert evals["initial"] <= 0.05  # the untrained model cannot spell a call, let alone guess a hidden value
    assert evals["after_sft"] >= 0.6 and evals["final"] >= 0.6, evals
    grpo = [r for r in rows if r.get("phase") == "grpo"]
    assert len(grpo) == 3 and summary["failed_samples"] == 0
    assert all(r["tool_calls"] >= 0.8 * 8 * 8 and r["reward_correct"] > 0.5 and r["rewrites"] == 0 for r in grpo)
