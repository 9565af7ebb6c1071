"""KeyLookup, the shipped tool-use env: the scripted player solves its tasks through the lookup tool; an answer
without the tool's result fails; bad calls are counted in the `invalid` component; the tool alphabet lets the
builtin tokenizer spell the calls and a bad alphabet is one config error line."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from rlfabric.agent_loop import EpisodeLimits, ScriptedTurns, episodes_to_trajectories, run_episodes
from rlfabric.config import ConfigError, config_from_dict
from rlfabric.envs.key_lookup import KeyLookup, careless_player, lookup_player, tool_call
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import DEFAULT_ALPHABET, TOOL_ALPHABET, build_char_tokenizer
from rlfabric.tasks import key_lookup_rows
from rlfabric.text_env import text_env_factory

LIMITS = EpisodeLimits(max_turns=3, turn_tokens=72, max_episode_tokens=1024)


def play(player, tasks, make_env=KeyLookup, limits=LIMITS):
    chat = ChatTokens(build_char_tokenizer(TOOL_ALPHABET))
    return asyncio.run(run_episodes(make_env, tasks, ScriptedTurns(player, chat), chat, limits)), chat


def test_the_lookup_player_solves_held_out_tasks_through_the_tool():
    tasks = key_lookup_rows(20, seed=3)
    episodes, chat = play(lookup_player, tasks, text_env_factory("rlfabric/KeyLookup-v0"))
    for task, episode in zip(tasks, episodes, strict=True):
        assert episode.error is None and episode.rewards == {"correct": 1.0}
        assert episode.tool_calls == 1 and episode.invalid_tool_calls == {} and len(episode.turns) == 2
        assert episode.texts == [tool_call(task["key"]), str(task["table"][task["key"]])]
    # The agent is shown the tools and the question, nothing of the table.
    env = KeyLookup()
    question = f"Value of key {tasks[0]['key']}?"
    opening = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": question}]
    assert "lookup(key)" in env.system_prompt
    shown = chat.tokenizer.decode(episodes[0].prompt)
    assert shown == chat.tokenizer.apply_chat_template(opening, tokenize=False, add_generation_prompt=True)
    traj = episodes_to_trajectories(episodes, list(range(20)), list(range(20)))
    assert traj.num_rows == 20


def test_without_the_tool_the_answer_is_a_guess_and_bad_calls_are_counted():
    tasks = key_lookup_rows(40, seed=4)

    def guesser(task, messages):  # answers at once: a value it cannot know
        return "mt"

    episodes, _ = play(guesser, tasks)
    assert all(e.tool_calls == 0 and len(e.turns) == 1 for e in episodes)
    assert sum(e.rewards["correct"] for e in episodes) == sum(t["table"][t["key"]] == "mt" for t in tasks) < 3

    wrong = tasks[0]["key"][::-1] + "q"  # not a key of the table

    def clumsy(task, messages):
        calls = len(messages) // 2 - 1  # turns played so far (system + question, then assistant/user pairs)
        if calls == 0:
            return '<tool_call>{"name": "lookup", "arguments": {key}}</tool_call>'  # not JSON
        if calls == 1:
            return tool_call(wrong)
        return lookup_player(task, messages)

    (episode,), _ = play(clumsy, tasks[:1])  # two bad calls, a good one: out of turns before it can answer
    assert episode.invalid_tool_calls == {"malformed": 1, "tool_error": 1} and episode.tool_calls == 2
    assert episode.rewards == {"invalid": 2.0} and episode.truncated and len(episode.turns) == 3
    (episode,), chat = play(clumsy, tasks[:1], limits=dataclasses.replace(LIMITS, max_turns=4))
    assert episode.rewards == {"invalid": 2.0, "correct": 1.0} and not episode.truncated  # it recovers
    assert "error: lookup raised KeyError" in chat.tokenizer.decode(episode.turns[1].observation)

    def silent(task, messages):
        return " "

    (episode,), _ = play(silent, tasks[:1])
    assert episode.rewards == {"invalid": 1.0} and not episode.truncated


def test_an_answer_is_the_value_alone_or_after_its_key():
    env = KeyLookup()
    asyncio.run(env.reset({"key": "xy", "table": {"ab": "qd", "xy": "mt"}}))
    for text, right in (("mt", True), (" xy=mt ", True), ("qd", False), ("mt please", False), ("xy=qd", False)):
        step = asyncio.run(env.step(text))
        assert step.terminated and step.rewards == {"correct": float(right)}, text


def test_the_careless_player_sometimes_answers_without_looking():
    tasks = key_lookup_rows(60, seed=5)
    episodes, _ = play(careless_player, tasks)
    looked = [e for e in episodes if e.tool_calls == 1]
    assert all(e.rewards == {"correct": 1.0} for e in looked)
    assert 0.5 < len(looked) / len(tasks) < 0.85  # a third of its episodes are guesses
    assert sum(e.rewards["correct"] for e in episodes) < len(looked) + 3


def test_the_default_alphabet_cannot_spell_a_call_so_the_tool_alphabet_exists():
    assert (
        build_char_tokenizer(DEFAULT_ALPHABET).get_vocab().keys()
        < build_char_tokenizer(TOOL_ALPHABET).get_vocab().keys()
    )
    with pytest.raises(Exception, match="UNK"):
        build_char_tokenizer(DEFAULT_ALPHABET)(tool_call("ab"), add_special_tokens=False)
    ids = build_char_tokenizer(TOOL_ALPHABET)(tool_call("ab"), add_special_tokens=False).input_ids
    assert len(ids) == len(tool_call("ab"))  # one token per character


@pytest.mark.parametrize("alphabet", ["0123456789", ""])
def test_a_bad_alphabet_is_one_config_error_line(alphabet):
    with pytest.raises(
        ConfigError, match=r"^model.builtin.alphabet = .* is not valid: lacks .*; allowed: a name \(default, tool\)"
    ) as err:
        config_from_dict({"algo": "grpo", "model": {"builtin": {"alphabet": alphabet}}})
    assert "\n" not in str(err.value)
    assert (
        config_from_dict({"algo": "grpo", "model": {"builtin": {"alphabet": "tool"}}}).model.builtin.alphabet == "tool"
    )


def test_tasks_are_reproducible_and_hide_the_answer_from_the_question():
    rows = key_lookup_rows(50, seed=1, table_size=3, key_length=2, value_length=3)
    assert rows == key_lookup_rows(50, seed=1, table_size=3, key_length=2, value_length=3)
    assert all(len(r["table"]) == 3 and r["key"] in r["table"] for r in rows)
    assert all(len(k) == 2 and len(v) == 3 and (k + v).isalpha() for r in rows for k, v in r["table"].items())
    assert len({r["prompt"] for r in rows}) == 50
    with pytest.raises(ValueError, match="table_size = 700"):
        key_lookup_rows(1, seed=0, table_size=700, key_length=2)


def test_envs_check_plays_one_turn_of_key_lookup(capsys):
    from rlfabric.cli import main

    assert main(["envs", "check", "rlfabric/KeyLookup-v0", "--task", '{"key": "ab", "table": {"ab": "qd"}}']) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK rlfabric/KeyLookup-v0 (text env): reset -> 'Value of key ab?'; step('') -> 'No answer.'")
    assert main(["envs", "check", "rlfabric/KeyLookup-v0", "--task", '{"key": "zz", "table": {"ab": "qd"}}']) == 1
    assert "must be a key of the task's table" in capsys.readouterr().out
