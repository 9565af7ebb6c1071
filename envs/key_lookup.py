"""KeyLookup: a tool-use task. Each task holds a small table of short keys and values (lowercase words) that the
agent never sees; the question asks for one key's value, and only the ``lookup`` tool reads the table. Without
calling it, an answer is a guess (right one time in 676 for two-letter values); with it, the task is copying the
key into the call and the tool's result into the answer.

A text env (rlfabric.text_env) built on ``rlfabric.tool_env.ToolEnv``: ``reset(task)`` with ``task = {"key": "xy",
"table": {"ab": "qd", "xy": "mt", ...}}`` asks ``Value of key xy?``; a turn with a Hermes call
``<tool_call>{"name":"lookup","arguments":{"key":"xy"}}</tool_call>`` gets the value (or an error) inside
``<tool_response>`` tags as its observation; the first turn without a call is the answer (``mt``, or ``xy=mt``)
and ends the episode. Reward components: ``correct`` 1 when the answer is the key's value (what
``eval_accuracy`` averages); ``invalid`` 1 per bad tool call (malformed, unknown tool, wrong arguments, a key not
in the table) and 1 for an empty answer. The builtin model needs ``model.builtin.alphabet: tool`` to spell the
calls. Spec: ``rlfabric/KeyLookup-v0`` (an entry point) or ``rlfabric.envs.key_lookup:KeyLookup``; tasks:
``data.train: task:key_lookup`` (``rlfabric.tasks``); ``lookup_player`` plays it perfectly and
``careless_player`` answers a guess without looking on a third of its episodes, for a supervised warm-up on their
demonstrations.

Why values are words, not numbers: the small character-level model learns to copy the key from the question
into the call within a few hundred warm-up steps, and then copies letters from the tool's reply with the same
circuit; digits in the reply needed one of their own, which formed after 400 to more than 1000 steps depending
on the seed.
"""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any

from rlfabric.text_env import TextStep
from rlfabric.tool_env import ToolEnv
from rlfabric.tools import ToolSet, tool_from_function

_QUESTION = re.compile(r"Value of key (\S+)\?")
_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
_CARELESS = random.Random(0)  # the careless player's slips: seeded, so a run's demonstrations repeat


class KeyTable:
    """The task ``ToolEnv`` wraps: the hidden table, the question, the ``lookup`` tool and the answer's score."""

    def __init__(self) -> None:
        self.table: dict[str, str] | None = None
        self.key = ""

    def reset(self, task: dict[str, Any]) -> str:
        table, key = task["table"], str(task["key"])
        if not isinstance(table, dict) or key not in table:
            raise ValueError(f"KeyLookup task key = {key!r}: must be a key of the task's table")
        self.table = {str(k): str(v) for k, v in table.items()}
        self.key = key
        return f"Value of key {key}?"

    def lookup(self, key: str) -> str:
        """The value stored under a key of the table."""
        if self.table is None:
            raise RuntimeError("KeyLookup lookup called before reset")
        if key not in self.table:
            raise KeyError(key)
        return self.table[key]

    def answer(self, text: str) -> TextStep:
        if self.table is None:
            raise RuntimeError("KeyLookup answer called before reset")
        said = text.strip().rsplit("=", 1)[-1].strip()  # "mt" or "xy=mt"
        if not said:
            return TextStep("No answer.", {"invalid": 1.0}, terminated=True)
        right = said == self.table[self.key]
        return TextStep("Right." if right else "Wrong.", {"correct": float(right)}, terminated=True)


class KeyLookup(ToolEnv):
    """See the module docstring. ``system_prompt``: the system message (None: ``ToolEnv``'s list of the tools and
    the call format; "": none, the shortest episodes, for a model that learns the format from demonstrations)."""

    def __init__(self, system_prompt: str | None = None, tool_timeout_s: float = 10.0) -> None:
        task = KeyTable()
        super().__init__(task, ToolSet([tool_from_function(task.lookup)]), tool_timeout_s=tool_timeout_s)
        if system_prompt is not None:
            self.system_prompt = system_prompt

    async def step(self, action: str) -> TextStep:
        step = await super().step(action)
        bad_calls = sum(step.info.get("invalid_tool_calls", {}).values())
        if bad_calls:
            step.rewards["invalid"] = step.rewards.get("invalid", 0.0) + bad_calls
        return step


def tool_call(key: str) -> str:
    """The Hermes call of ``lookup`` on ``key`` as the players write it (compact JSON: fewer characters)."""
    call = {"name": "lookup", "arguments": {"key": key}}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def lookup_player(task: dict[str, Any], messages: list[dict[str, str]]) -> str:
    """The scripted player (``sft.player: rlfabric.envs.key_lookup:lookup_player``): calls ``lookup`` on the key
    the question names, then answers with what the tool returned (or calls again after an error), both read from
    the chat."""
    if len(messages) >= 2 and messages[-2]["role"] == "assistant":  # a call was made: read its response
        response = _RESPONSE.search(messages[-1]["content"])
        if response and not response.group(1).startswith("error:"):
            return response.group(1)
    question = next((m["content"] for m in messages if m["role"] == "user"), "")
    asked = _QUESTION.search(question)
    return tool_call(asked.group(1) if asked else str(task.get("key", "")))


def careless_player(task: dict[str, Any], messages: list[dict[str, str]]) -> str:
    """``lookup_player`` that answers a guess (two random letters) without looking on a third of its episodes:
    demonstrations that teach the call and the copy but not always to use the tool, leaving that to GRPO."""
    if (len(messages) < 2 or messages[-2]["role"] != "assistant") and _CARELESS.random() < 1 / 3:
        return "".join(_CARELESS.choice(string.ascii_lowercase) for _ in range(2))
    return lookup_player(task, messages)
