"""A tool-using episode: the agent calls a tool, reads its result, answers; bad calls are error observations,
counted by kind, and the episode goes on."""

from __future__ import annotations

import asyncio
import re

from rlfabric.agent_loop import EpisodeLimits, ScriptedTurns, episodes_to_trajectories, run_episodes
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import DEFAULT_ALPHABET, build_char_tokenizer
from rlfabric.text_env import TextStep
from rlfabric.tool_env import ToolEnv
from rlfabric.tools import ToolSet


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


class Product:
    """Asks for a product the agent cannot work out in one go; scores the answer."""

    def reset(self, task):
        self.a, self.b = task["a"], task["b"]
        return f"What is {self.a}*{self.b}?"

    def answer(self, text):
        right = str(self.a * self.b) in text
        return TextStep("Right." if right else "Wrong.", {"correct": float(right)}, terminated=True)


def calculator_player(task, messages):
    """Calls the tool first (after a few bad calls when the task asks for them), then answers with its result."""
    replies = [m["content"] for m in messages if m["role"] == "user"][1:]
    bad = task.get("bad_calls", [])
    if len(replies) < len(bad):
        return bad[len(replies)]
    results = [re.search(r"<tool_response>\n(-?\d+)\n", r) for r in replies]
    found = [r.group(1) for r in results if r]
    if found:
        return f"It is {found[-1]}."
    return f'<tool_call>{{"name": "multiply", "arguments": {{"a": {task["a"]}, "b": {task["b"]}}}}}</tool_call>'


def test_an_agent_calls_a_tool_reads_its_result_and_answers_and_bad_calls_are_counted_by_kind():
    tok = build_char_tokenizer(DEFAULT_ALPHABET + "{}\"_[]'")  # room for JSON and quoted names
    chat = ChatTokens(tok)
    bad_calls = [
        "<tool_call>{multiply}</tool_call>",
        '<tool_call>{"name": "divide", "arguments": {"a": 1}}</tool_call>',
        '<tool_call>{"name": "multiply", "arguments": {"a": "x", "b": 2}}</tool_call>',
    ]
    tasks = [{"a": 123, "b": 45}, {"a": 77, "b": 91, "bad_calls": bad_calls}]
    episodes = asyncio.run(
        run_episodes(
            lambda: ToolEnv(Product(), ToolSet([multiply])),
            tasks,
            ScriptedTurns(calculator_player, chat),
            chat,
            EpisodeLimits(max_turns=6, max_episode_tokens=2048),
        )
    )
    clean, clumsy = episodes
    assert clean.rewards == {"correct": 1.0} and clean.texts[-1] == "It is 5535." and len(clean.turns) == 2
    assert clean.tool_calls == 1 and clean.invalid_tool_calls == {}
    assert "<tool_response>\n5535\n</tool_response>" in tok.decode(clean.turns[0].observation)
    assert clumsy.rewards == {"correct": 1.0} and len(clumsy.turns) == 5  # three bad calls, one good, the answer
    assert clumsy.invalid_tool_calls == {"malformed": 1, "unknown_tool": 1, "invalid_arguments": 1}
    assert "error: unknown tool 'divide'" in tok.decode(clumsy.turns[1].observation)
    traj = episodes_to_trajectories(episodes, [0, 1], [0, 0])
    assert traj.num_rows == 2 and len(traj.step_spans) == 7
