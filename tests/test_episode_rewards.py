"""Reward functions on a text env's episodes: an episode as one reward input (its opening, its turns and the
observations between them, one step per turn), the scores placed on its turns, and a GRPO run that trains with
an outcome and a process reward function beside the env's own components."""

from __future__ import annotations

import asyncio
import json

import pytest
from grpo_runs import run_grpo

from rlfabric.agent_loop import EpisodeLimits, ScriptedTurns, episodes_to_trajectories, run_episodes
from rlfabric.agent_rollout import agent_trajectories
from rlfabric.agent_trace import AgentTrace, assistant_message
from rlfabric.agents import AgentEpisode
from rlfabric.config import config_from_dict
from rlfabric.envs.guess_number import GuessNumber
from rlfabric.episode_rewards import add_agent_scores, add_scores, agent_episode_input, episode_input, score_episodes
from rlfabric.llm_actors import actor_requests
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import build_char_tokenizer
from rlfabric.rewards import RewardInput, RewardResult, pointwise, process_reward, register_reward


def scripted(guesses: list[str]):
    """A player that says ``guesses`` in order, one per turn."""

    def player(task, messages):
        return guesses[sum(m["role"] == "assistant" for m in messages)]

    return player


def played(secret: int, guesses: list[str], max_turns: int = 5):
    chat = ChatTokens(build_char_tokenizer())
    turns = ScriptedTurns(scripted(guesses), chat)
    (episode,) = asyncio.run(
        run_episodes(lambda: GuessNumber(16), [{"secret": secret}], turns, chat, EpisodeLimits(max_turns=max_turns))
    )
    return episode


def test_an_episode_is_one_reward_input_with_a_step_per_turn():
    episode = played(3, ["5", "2", "3"])
    reward_input = episode_input(episode, {"secret": 3, "prompt": "unused"}, "prompt")
    assert reward_input.prompt == "Guess my number, 1 to 16."
    # "5" -> lower, "2" -> higher, "3" -> Right. (the last observation ends the episode: the policy never sees it)
    assert reward_input.steps == ["5", "\nlower\n2", "\nhigher\n3"]
    assert reward_input.completion == "5\nlower\n2\nhigher\n3"
    assert reward_input.metadata == {"secret": 3}
    assert reward_input.finish_reason == "stop" and reward_input.num_tokens == 6  # each guess and its end token

    cut = played(3, ["9", "8", "7"], max_turns=2)
    assert episode_input(cut, {"secret": 3}, "prompt").finish_reason == "length"


def test_scores_become_per_turn_rewards_outcome_on_the_last_turn():
    episode = played(3, ["5", "x", "3"])  # the env: invalid on turn 1, correct on turn 2
    add_scores(episode, RewardResult({"short": -0.5}, None, [{"judged": 1.0}, {"judged": 0.0}, {"judged": 0.5}]))
    assert [t.rewards for t in episode.turns] == [
        {"judged": 1.0},
        {"invalid": 1.0, "judged": 0.0},
        {"correct": 1.0, "judged": 0.5, "short": -0.5},
    ]
    record = episodes_to_trajectories([episode], [0], [0])
    assert record.step_rewards["judged"].tolist() == [1.0, 0.0, 0.5]
    assert record.final_rewards["judged"].tolist() == [1.5] and record.final_rewards["short"].tolist() == [-0.5]
    assert record.final_rewards["correct"].tolist() == [1.0]


def test_a_failed_score_or_a_component_the_env_gives_too_fails_the_episode():
    failed = played(3, ["3"])
    add_scores(failed, RewardResult({}, "judge: ValueError: no verdict"))
    assert failed.error == "judge: ValueError: no verdict"
    clash = played(3, ["3"])
    add_scores(clash, RewardResult({"correct": 1.0, "z": 0.0}))
    assert clash.error == "reward component 'correct' comes from both the env and rewards.functions: rename one of them"
    assert clash.turns[0].rewards == {"correct": 1.0}  # nothing was added


def test_each_group_of_finished_episodes_is_scored_in_one_call():
    episodes = [played(3, ["3"]), played(3, ["1", "3"]), played(5, ["5"]), played(5, ["9", "1", "5"])]
    episodes[2].error = "step missed its 5s deadline"
    calls = []

    def score(groups: list[list[RewardInput]]) -> list[list[RewardResult]]:
        calls.append([[i.completion for i in g] for g in groups])
        return [[RewardResult({"chars": float(len(i.completion))}) for i in g] for g in groups]

    score_episodes(score, episodes, [{"secret": 3}] * 2 + [{"secret": 5}] * 2, 2, "prompt")
    # one call: group 0 (episodes 0 and 1), group 1 (episode 3; episode 2 failed and is not scored)
    assert calls == [[["3", "1\nhigher\n3"], ["9\nlower\n1\nhigher\n5"]]]
    assert [e.turns[-1].rewards.get("chars") for e in episodes] == [1.0, 10.0, None, 18.0]


def test_guess_numbers_process_reward_marks_the_turns_that_ignore_the_replies():
    from rlfabric.envs.guess_number import consistent_guesses

    # 1..16, secret 7: "8" lower (1..7), "9" is above 7, "x" names nothing, "7" right
    careless = episode_input(played(7, ["8", "9", "x", "7"]), {"secret": 7}, "prompt")
    # "8" lower (1..7), "3" higher (4..7), "6" higher (7..7), "7" right: every guess in the range left
    careful = episode_input(played(7, ["8", "3", "6", "7"]), {"secret": 7}, "prompt")
    scores = consistent_guesses([careless, careful])
    assert [[s["inconsistent"] for s in turns] for turns in scores] == [[0, 1, 1, 0], [0, 0, 0, 0]]


def agent_episode(calls: list[tuple[list[dict], str]]) -> AgentEpisode:
    """An outside agent's episode whose calls send these messages and get these replies (a few sampled tokens
    each, for the trace)."""
    chat = ChatTokens(build_char_tokenizer())
    trace = AgentTrace(chat)
    for version, (messages, reply) in enumerate(calls):
        call = trace.prepare(messages, tools=None)
        sampled = chat.text_ids(reply)
        assert trace.commit(call, sampled, [-0.5] * len(sampled), version, assistant_message(reply, []))
    return AgentEpisode(0, trace)


def test_an_agents_conversation_is_one_step_per_model_call_and_process_scores_land_on_those_calls():
    system, ask = {"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}
    first = [system, ask]
    second = [*first, {"role": "assistant", "content": "4"}, {"role": "user", "content": "no"}]
    third = [*second, {"role": "assistant", "content": "5"}, {"role": "user", "content": "sure?"}]
    episode = agent_episode([(first, "4"), (second, "5"), (third, "yes")])
    assert len(episode.trace.segments) == 1  # each call continued the last: one row, three turns
    reward_input = agent_episode_input(episode, {"prompt": "unused"}, "prompt")
    assert reward_input.prompt == "2+3?"
    assert reward_input.steps == ["assistant: 4", "\nuser: no\nassistant: 5", "\nuser: sure?\nassistant: yes"]
    assert "".join(reward_input.steps) == reward_input.completion

    add_agent_scores(episode, RewardResult({"brief": 1.0}, None, [{"right": 0.0}, {"right": 1.0}, {"right": 0.5}]))
    assert episode.error is None and episode.rewards == {"brief": 1.0, "right": 1.5}
    record = agent_trajectories([episode], [0], [0])
    assert record.step_rewards["right"].tolist() == [0.0, 1.0, 0.5]  # one step span per call
    assert record.step_rewards["brief"].tolist() == [0.0, 0.0, 1.0]  # the outcome on the last call
    assert record.final_rewards["right"].tolist() == [1.5]


def test_a_rewritten_history_scores_the_last_conversation_and_gives_earlier_rows_its_totals():
    ask = {"role": "user", "content": "2+3?"}
    edited = [ask, {"role": "assistant", "content": "five"}, {"role": "user", "content": "digits"}]
    # the second call hands back a reply the policy did not give ("five"): a new segment, whose only turn is "5"
    episode = agent_episode([([ask], "4"), (edited, "5")])
    assert len(episode.trace.segments) == 2
    reward_input = agent_episode_input(episode, {}, "prompt")
    # step 0 holds every line up to the segment's first own reply, the edited assistant message included
    assert reward_input.steps == ["assistant: five\nuser: digits\nassistant: 5"]
    add_agent_scores(episode, RewardResult({}, None, [{"right": 1.0}]))
    record = agent_trajectories([episode], [0], [0])
    assert record.final_rewards["right"].tolist() == [1.0, 1.0]  # every row of the episode trains on its totals

    mismatched = agent_episode([([ask], "4"), ([ask, {"role": "assistant", "content": "4"}, ask], "5")])
    add_agent_scores(mismatched, RewardResult({}, None, [{"right": 1.0}] * 3))
    assert mismatched.error == "a process reward scored 3 steps of a conversation of 2 turns"


# -- a run -----------------------------------------------------------------------------------------------------


@pointwise
def turns_taken(inputs: list[RewardInput]) -> list[dict[str, float]]:
    """An outcome reward: minus the number of turns (steps) of each episode."""
    return [{"turn_cost": -float(len(sample.step_texts()))} for sample in inputs]


@pointwise
@process_reward
def names_a_number(inputs: list[RewardInput]) -> list[list[dict[str, float]]]:
    """A process reward: 1 for each turn whose own text (after "\n" observation "\n" from the second step on) has a
    digit."""
    out = []
    for sample in inputs:
        turns = [step if k == 0 else step.split("\n", 2)[2] for k, step in enumerate(sample.step_texts())]
        out.append([{"numeric": float(any(c.isdigit() for c in turn))} for turn in turns])
    return out


register_reward("turns_taken", turns_taken)
register_reward("names_a_number", names_a_number)

GAME = {
    "model": {"builtin": {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "max_positions": 256}},
    "data": {"train": "task:guess_number?min_high=4&max_high=10", "num_train": 16, "num_eval": 6},
    "env": {"id": "rlfabric/GuessNumber-v0", "max_turns": 3, "step_timeout_s": 5.0},
    "rewards": {
        "functions": [{"name": "turns_taken"}, {"name": "names_a_number"}],
        "weights": {"invalid": -0.5, "turn_cost": 0.1, "numeric": 0.2},
    },
    "sampling": {"max_new_tokens": 4},
}


def test_grpo_on_a_text_env_trains_with_outcome_and_process_reward_functions(local_ray, tmp_path):
    run = run_grpo(tmp_path / "run", training={"total_steps": 3, "show_samples": 4}, **GAME)
    steps = run.phase("grpo")
    assert len(steps) == 3 and sum(r["trained_rows"] for r in steps) > 0
    for row in steps:
        # the outcome function counted the turns the env played; the means are over the same episodes
        assert row["reward_turn_cost"] == pytest.approx(-row["turns_mean"], abs=1e-5)
        # a turn names a number or the env calls it invalid: per episode, numeric + invalid = turns
        assert row["reward_numeric"] + row.get("reward_invalid", 0.0) == pytest.approx(row["turns_mean"], abs=1e-5)
        assert row["failed_samples"] == 0
    shown = [json.loads(line) for line in (run.run_dir / "samples.jsonl").read_text().splitlines()]
    assert shown and all({"turn_cost", "numeric"} <= set(s["components"]) for s in shown)
    for sample in shown:  # the episode as the policy saw it: the env's opening, each turn and the env's reply
        parts = sample["completion"].split(" | ")
        assert parts[0].startswith("env: ") and parts[1].startswith("policy: "), sample["completion"]
        assert 1 <= sum(part.startswith("policy: ") for part in parts) <= 3, sample["completion"]  # env.max_turns


async def two_calls(task, client):
    """Asks, then asks again with the whole history (one exact segment); returns its own ``correct``."""
    opening = [{"role": "user", "content": f"Value of key {task['key']}?"}]
    first = await client.chat.completions.create(model="policy", messages=opening)
    history = [*opening, first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    second = await client.chat.completions.create(model="policy", messages=history)
    return {"correct": float(len(second.choices[0].message.content or "") % 2 == 0)}


@pointwise
def assistant_turns(inputs: list[RewardInput]) -> list[dict[str, float]]:
    """The assistant messages of the conversation after the prompt, one a line as "role: text"; and whether the
    prompt is the agent's opening question."""
    return [
        {
            "assistant_turns": float(x.completion.startswith("assistant: ") + x.completion.count("\nassistant: ")),
            "asked": float(x.prompt.startswith("Value of key ")),
        }
        for x in inputs
    ]


@pointwise
def claims_correct(inputs: list[RewardInput]) -> list[dict[str, float]]:
    return [{"correct": 1.0} for _ in inputs]


@pointwise
@process_reward
def one_per_step(inputs: list[RewardInput]) -> list[list[dict[str, float]]]:
    """A process reward: 1 for each step, so its episode total is the number of steps the conversation has."""
    return [[{"steps": 1.0} for _ in x.step_texts()] for x in inputs]


register_reward("assistant_turns", assistant_turns)
register_reward("one_per_step", one_per_step)
register_reward("claims_correct", claims_correct)
AGENT_RUN = {
    "model": {"builtin": {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "max_positions": 256}},
    "data": {"train": "task:key_lookup", "num_train": 16, "num_eval": 4},
    "env": {"agent": "tests-two-calls"},
    "sampling": {"max_new_tokens": 6},
    "training": {"total_steps": 2, "eval_every": 0},
}


def test_reward_functions_score_an_outside_agents_conversations(local_ray, tmp_path):
    from rlfabric.agents import register_agent

    register_agent("tests-two-calls", two_calls)
    functions = [{"name": "assistant_turns"}, {"name": "one_per_step"}]
    run = run_grpo(tmp_path / "run", rewards={"functions": functions}, **AGENT_RUN)
    steps = run.phase("grpo")
    assert len(steps) == 2 and all(r["failed_samples"] == 0 for r in steps)
    # each conversation after the opening question: assistant, user "again", assistant
    assert all(r["reward_assistant_turns"] == 2.0 and r["reward_asked"] == 1.0 for r in steps)
    # the process reward saw one step per model call: two per episode
    assert all(r["reward_steps"] == 2.0 for r in steps)
    assert all("reward_correct" in r for r in steps)  # the agent's own component beside them


def test_a_component_both_the_agent_and_a_reward_function_give_stops_the_run_naming_it(local_ray, tmp_path):
    from rlfabric.actor_slots import RunAbortedError
    from rlfabric.agents import register_agent

    register_agent("tests-two-calls", two_calls)
    with pytest.raises(RunAbortedError, match="reward component 'correct' comes from both the agent and rewards"):
        run_grpo(tmp_path / "run", rewards={"functions": [{"name": "claims_correct"}]}, **AGENT_RUN)


def test_a_config_that_plays_episodes_and_names_no_reward_function_gets_none():
    from grpo_runs import BASE, merged

    plain = merged({k: v for k, v in BASE.items() if k != "rewards"}, {"env": GAME["env"], "data": GAME["data"]})
    assert config_from_dict(plain).rewards.functions == []  # not the single-turn default (arithmetic)
    named = merged(plain, {"rewards": {"functions": [{"name": "turns_taken"}]}})
    assert [f.name for f in config_from_dict(named).rewards.functions] == ["turns_taken"]

    # reward workers are asked for (CPUs, a placement group's bundles) only where there are functions to run
    def reward_workers(cfg: dict) -> int:
        return {r.role: r.count for r in actor_requests(config_from_dict(cfg))}["rewards"]

    assert reward_workers(plain) == 0
    assert reward_workers(merged(named, {"rewards": {"num_workers": 3}})) == 3
