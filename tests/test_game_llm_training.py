"""A language-model policy that learns in a game: its moves as token rows with their returns, the config that asks
for it, and a run where it learns (through the public ``train``), resumes, and saves its model."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray
from game_envs import pick_one

import rlfabric
from rlfabric.config import ConfigError, config_from_dict
from rlfabric.game_driver import check_game_config, ppo_trainer, ppo_trainer_from_run_dir, train
from rlfabric.multiagent.games import AgentStream
from rlfabric.multiagent.llm_turns import LLMTurn, LLMTurnBuffer


def moves(stream: AgentStream, steps: list[tuple[int, float, bool, bool]]) -> AgentStream:
    """Close one move per (token, reward, terminated, invalid) on ``stream``, as a game copy does."""
    for token, reward, terminated, invalid in steps:
        turn = LLMTurn([5, 6, 7], [token], [-0.5], version=3, invalid=invalid)
        stream.open(np.zeros(1), None, None, 0, 0.0, 3, turn)
        stream.close(reward, terminated, False, np.zeros(1), None)
    return stream.take()


def test_moves_wait_for_the_end_of_their_episode_and_carry_its_return():
    buffer = LLMTurnBuffer("player")
    buffer.add(
        0, "x", moves(AgentStream(True), [(10, 0.0, False, False), (11, 1.0, True, True), (12, 0.0, False, False)])
    )
    buffer.add(1, "o", moves(AgentStream(True), [(20, 0.0, False, True)]))
    first = buffer.take_finished(first_episode_id=100)
    assert first.num_rows == 2  # copy 0's finished episode; its third move and copy 1's move are still in play
    assert first.agent_id.tolist() == ["x", "x"] and first.policy_id.tolist() == ["player", "player"]
    assert first.final_rewards["return"].tolist() == [1.0, 1.0]
    assert first.final_rewards["invalid"].tolist() == [0.0, 1.0]
    assert first.episode_id.tolist() == [100, 101]
    assert [row[mask > 0].tolist() for row, mask in zip(first.tokens, first.loss_mask, strict=True)] == [[10], [11]]

    buffer.add(0, "x", moves(AgentStream(True), [(13, -1.0, True, False)]))
    buffer.add(1, "o", moves(AgentStream(True), [(21, 0.5, True, False)]))
    second = buffer.take_finished(first_episode_id=102)
    by_agent = dict(zip(second.agent_id.tolist(), second.final_rewards["return"].tolist(), strict=False))
    assert second.num_rows == 4 and by_agent == {"x": -1.0, "o": 0.5}
    assert sorted(second.final_rewards["return"].tolist()) == [-1.0, -1.0, 0.5, 0.5]
    assert buffer.take_finished(first_episode_id=106).num_rows == 0


def test_returns_restart_at_each_episode_end():
    buffer = LLMTurnBuffer("player")
    steps = [(1, 0.0, False, False), (2, 0.0, False, False), (3, 1.0, True, False)]  # episode one
    steps += [(4, 0.5, False, False), (5, -1.0, True, False), (6, 2.0, False, False)]  # two; three begun
    buffer.add(0, "x", moves(AgentStream(True), steps))
    # by hand: episode one 0+0+1, 0+1, 1; episode two 0.5-1, -1; the third episode's move waits for its end
    assert buffer.take_finished(0).final_rewards["return"].tolist() == [1.0, 1.0, 1.0, -0.5, -1.0]
    buffer.add(0, "x", moves(AgentStream(True), [(7, 3.0, True, False)]))
    assert buffer.take_finished(5).final_rewards["return"].tolist() == [5.0, 3.0]


def pick_config(total_env_steps: int, **policy) -> dict:
    spec = {"kind": "llm", "model": "builtin", "render": "game_envs:pick_prompt", "max_new_tokens": 2, **policy}
    return {
        "algo": "ppo",
        "env": {"id": "pick-one"},
        "runners": {"num_runners": 1, "envs_per_runner": 16},
        "ppo": {"train_batch_size": 64, "minibatch_size": 64},
        "multi_agent": {"policies": {"picker": spec}},
        "training": {"total_env_steps": total_env_steps, "eval_episodes": 0, "seed": 0, "checkpoint_every": 10},
    }


@pytest.mark.parametrize(
    "policy, field",
    [
        ({}, r"multi_agent.policies = \['picker'\] is not valid: at least one policy must train: kind neural"),
        ({"train": True, "lr": 0.0}, "multi_agent.policies.picker.lr"),
        ({"train": True, "invalid_move_penalty": -1.0}, "multi_agent.policies.picker.invalid_move_penalty"),
    ],
)
def test_a_game_config_that_cannot_train_a_language_model_says_which_field(policy, field):
    with pytest.raises(ConfigError, match=field):
        config_from_dict(pick_config(640, **policy))


@pytest.mark.parametrize("field", ["ppo.normalize_obs", "ppo.normalize_reward"])
def test_normalizing_is_refused_where_no_neural_policy_trains(field):
    cfg = pick_config(640, train=True)
    cfg["env"]["id"] = "game_envs:pick_one"
    cfg["ppo"][field.split(".")[1]] = True
    with pytest.raises(ConfigError, match=rf"{field} = true is not valid here: .* no trainable neural policy"):
        check_game_config(config_from_dict(cfg))


def test_train_is_refused_for_a_policy_that_is_not_a_language_model():
    cfg = pick_config(640, train=True)
    cfg["multi_agent"]["policies"]["other"] = {"kind": "random", "train": True}
    cfg["multi_agent"]["policy_mapping"] = {"left": "picker", "right": "other"}
    with pytest.raises(ConfigError, match="multi_agent.policies.other.train = True is not valid: only an llm policy"):
        config_from_dict(cfg)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"iteration"' in line]


@pytest.mark.slow
def test_a_language_model_learns_the_rewarded_move_resumes_and_saves_its_model(local_ray, tmp_path):
    """PickOne rewards 1 for replying 1 (of 0, 1, 2): the untrained model names no legal move in most replies and
    picks 1 in about a third of its moves; trained on its moves it nearly always replies 1. A resumed run continues
    from the checkpoint's weights (not the initial model), and the final model is a Hugging Face folder that a
    later run can play."""
    rlfabric.register_env("pick-one", pick_one)
    run_dir = tmp_path / "run"
    summary = train(config_from_dict(pick_config(1280, train=True, lr=1e-3)), run_dir, quiet=True)
    first = rows(run_dir)
    assert len(first) == 20 and [r["policy_version"] for r in first] == list(range(1, 21))
    assert first[0]["return_mean/picker"] < 0.5 and first[-1]["return_mean/picker"] > 0.85
    moves, invalid = first[0]["llm_moves/picker"], first[0]["llm_invalid_moves/picker"]
    assert invalid / moves > 0.7  # the untrained model
    late = [
        r["llm_invalid_moves/picker"] - e["llm_invalid_moves/picker"] for e, r in zip(first, first[1:], strict=False)
    ]
    assert sum(late[-5:]) / (5 * 128) < 0.2  # 128 moves an iteration: two agents x 64 env steps
    assert all(r["trained_moves"] == 128 for r in first)  # one-move episodes: every move trains at once

    model = Path(summary["llm_models"]["picker"])
    assert (model / "config.json").is_file() and (model / "tokenizer_config.json").is_file()

    trainer = ppo_trainer_from_run_dir(run_dir, ["training.total_env_steps=1920"], quiet=True)
    try:
        trainer.train()
    finally:
        trainer.close()
    later = rows(run_dir)[len(first) :]
    assert [r["policy_version"] for r in later] == list(range(21, 31))
    assert later[0]["return_mean/picker"] > 0.85  # the trained weights, not the initial model's 0.35

    # the saved model plays in another run as a frozen llm policy
    frozen = pick_config(128, model=str(model))
    frozen["multi_agent"]["policies"]["learner"] = {}
    frozen["multi_agent"]["policy_mapping"] = {"left": "picker", "right": "learner"}
    played = train(config_from_dict(frozen), tmp_path / "replay", quiet=True)
    assert played["llm_moves"]["picker"]["moves"] == 128
    assert played["llm_moves"]["picker"]["invalid"] < 40


def test_an_iteration_with_no_finished_episode_still_advances_the_version(local_ray, tmp_path):
    """The driver counts one version per iteration for every trainable policy (a neural one beside it advances):
    an update with no finished moves keeps the weights and advances the version all the same."""
    from rlfabric.actors.game_llm_learner import GameLLMLearner
    from rlfabric.models.hf import build_small_model_dir

    model_dir = str(build_small_model_dir(tmp_path / "model", num_layers=1, hidden_size=32, num_heads=2))
    learner = GameLLMLearner.remote(
        model_dir, None, lr=1e-3, invalid_move_penalty=1.0, temperature=1.0, max_new_tokens=2, seed=0
    )
    before = ray.get(learner.state.remote())["model"]
    empty = LLMTurnBuffer("picker").take_finished(first_episode_id=0)
    assert ray.get(learner.update_from_refs.remote([ray.put(empty)])) == {"trained_moves": 0.0}
    after = ray.get(learner.state.remote())
    assert after["version"] == 1 and all(np.array_equal(before[k], after["model"][k]) for k in before)
    ray.kill(learner)


def test_a_frozen_policy_cannot_load_a_language_model_from_a_checkpoint(local_ray, tmp_path):
    rlfabric.register_env("pick-one", pick_one)
    run_dir = tmp_path / "llm_run"
    train(config_from_dict(pick_config(64, train=True)), run_dir, quiet=True)
    cfg = pick_config(64, train=True)
    cfg["multi_agent"]["policies"]["old"] = {"kind": "frozen", "checkpoint": str(run_dir), "from_policy": "picker"}
    cfg["multi_agent"]["policy_mapping"] = {"left": "picker", "right": "old"}
    with pytest.raises(ConfigError, match="its policy 'picker' is a language model"):
        check_game_config(config_from_dict(cfg))


@pytest.mark.slow
def test_a_killed_generator_is_replaced_and_serves_the_trained_weights(local_ray, tmp_path):
    """SIGKILL of the generator serving a trained language-model policy, mid-run: the driver starts a new one, the
    learner loads its current weights into it, and the run goes on with every iteration trained (the moves after
    the kill are played by the trained model, not the initial one, whose replies are mostly not a legal move)."""
    rlfabric.register_env("pick-one", pick_one)
    run_dir = tmp_path / "run"
    trainer = ppo_trainer(config_from_dict(pick_config(1280, train=True, lr=1e-3)), run_dir, quiet=True)
    killed: list[int] = []

    def kill_generator_after(rows_logged: int) -> None:
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count('"iteration"') >= rows_logged):
            time.sleep(0.05)
        pid = ray.get(trainer.llm_servers.serving()["picker"].handle.pid.remote())
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    thread = threading.Thread(target=kill_generator_after, args=(12,), daemon=True)
    thread.start()
    try:
        trainer.train()
        replacement = trainer.llm_servers.serving()["picker"].handle
        assert ray.get(replacement.version.remote(), timeout=30) == 20  # the final weights reached the replacement
        assert ray.get(replacement.pid.remote(), timeout=30) not in killed
        assert trainer.llm_servers.slots.restarts == 1
    finally:
        trainer.close()
    thread.join(timeout=5)
    logged = rows(run_dir)
    assert killed and [r["policy_version"] for r in logged] == list(range(1, 21))
    assert all(r["trained_moves"] > 0 for r in logged)
    # invalid replies per iteration after the kill: the trained model's few, not the initial model's >70%
    counts = [r["llm_invalid_moves/picker"] for r in logged]
    per_iteration = [b - a for a, b in zip(counts[11:], counts[12:], strict=False)]
    assert max(per_iteration) / 128 < 0.4


def test_a_generators_run_of_failures_is_ended_only_by_work_of_its_current_generation(local_ray, tmp_path):
    """A sample the current generator answered ends its run of failures; one that comes back late, played on a
    generator since replaced, does not: a generator that fails every call stops the run at the limit, however many
    such samples return meanwhile."""
    from rlfabric.actor_slots import MAX_CONSECUTIVE_FAILURES
    from rlfabric.game_llm_servers import LLMServers
    from rlfabric.multiagent.config import PolicySpec
    from rlfabric.policies.served import GeneratorsFailed
    from rlfabric.runner_pool import RunAbortedError

    def fail_current() -> tuple[int, int]:
        slot, generation, _ = servers.slots.entries()[0]
        assert servers.replace_failed(GeneratorsFailed([(slot, generation, "boom")])) == ["picker"]
        return slot, generation

    servers = LLMServers({"picker": PolicySpec(kind="llm", render="tictactoe")}, ["picker"], tmp_path, seed=0)
    try:
        for _ in range(2):  # one failure, then the replacement answers: the run of failures ends each time
            fail_current()
            servers.succeeded([servers.slots.entries()[0][:2]])
        for _ in range(MAX_CONSECUTIVE_FAILURES - 1):
            servers.succeeded([fail_current()])  # a sample the replaced generator answered, back late
        with pytest.raises(RunAbortedError, match=f"generator 0 failed {MAX_CONSECUTIVE_FAILURES + 1} times"):
            fail_current()
            fail_current()
        assert servers.slots.restarts == 2 + MAX_CONSECUTIVE_FAILURES
    finally:
        servers.shutdown()
