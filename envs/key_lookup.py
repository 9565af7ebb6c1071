"""KeyLookup: a tool-use task. Each task holds a small table of keys and numbers that the agent never sees; the
question asks for one key's value, and only the ``lookup`` tool reads the table. Without calling it, an answer is
a guess (right one time in ninety for two-digit values); with it, the task is copying the key into the call and
the tool's result into the answer.

A text env (rlfabric.text_env) built on ``rlfabric.tool_env.ToolEnv``: ``reset(task)`` with ``task = {"key": "xy",
"table": {"ab": 41, "xy": 73, ...}}`` asks ``Value of key xy?``; a turn with a Hermes call
``<tool_call>{"name": "lookup", "arguments": {"key": "xy"}}</tool_call>`` gets ``<tool_response>`` with the value
(or an error) as its observation; the first turn without a call is the answer, and ends the episode. Reward
components: ``correct`` 1 when the answer's first integer is the key's value (what ``eval_accuracy`` averages);
``invalid`` 1 per bad tool call (malformed, unknown tool, wrong arguments, a key not in the table) and 1 for an
answer without a number (weight it negatively in ``rewards.weights``). The builtin model needs
``model.builtin.alphabet: tool`` to spell the calls. Spec: ``rlfabric/KeyLookup-v0`` (an entry point) or
``rlfabric.envs.key_lookup:KeyLookup``; tasks: ``data.train: task:key_lookup`` (``rlfabric.tasks``);
``lookup_player`` plays it perfectly and ``careless_player`` sometimes answers without looking, for a supervised
warm-up on their demonstrations.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from rlfabric.text_env import TextStep
from rlfabric.tool_env import ToolEnv
from rlfabric.tools import ToolSet, tool_from_function

_NUMBER = re.compile(r"-?\d+")
_QUESTION = re.compile(r"Value of key (\S+)\?")
_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
_CARELESS = random.Random(0)  # the careless player's slips: seeded, so a run's demonstrations repeat


class KeyTable:
    """The task ``ToolEnv`` wraps: the hidden table, the question, the ``lookup`` tool and the answer's score."""

    def __init__(self) -> None:
        self.table: dict[str, int] | None = None
        self.key = ""

    def reset(self, task: dict[str, Any]) -> str:
        table, key = task["table"], str(task["key"])
        if not isinstance(table, dict) or key not in table:
            raise ValueError(f"KeyLookup task key = {key!r}: must be a key of the task's table")
        self.table = {str(k): int(v) for k, v in table.items()}
        self.key = key
        return f"Value of key {key}?"

    def lookup(self, key: str) -> str:
        """The value stored under a key of the table."""
        if self.table is None:
            raise RuntimeError("KeyLookup lookup called before reset")
        if key not in self.table:
            raise KeyError(key)
        return str(self.table[key])

    def answer(self, text: str) -> TextStep:
        if self.table is None:
            raise RuntimeError("KeyLookup answer called before reset")
        found = _NUMBER.search(text)
        if found is None:
            return TextStep("No number.", {"invalid": 1.0}, terminated=True)
        right = int(found.group()) == self.table[self.key]
        return TextStep("Right." if right else "Wrong.", {"correct": 1.0 if right else 0.0}, terminated=True)


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
    """The Hermes call of ``lookup`` on ``key``, as ``lookup_player`` writes it."""
    return f"<tool_call>{json.dumps({'name': 'lookup', 'arguments': {'key': key}})}</tool_call>"


def lookup_player(task: dict[str, Any], messages: list[dict[str, str]]) -> str:
    """The scripted player (``sft.player: rlfabric.envs.key_lookup:lookup_player``): calls ``lookup`` on the key
    the question names, then answers with the number the tool returned (or calls again after an error), both read
    from the chat."""
    if len(messages) >= 2 and messages[-2]["role"] == "assistant":  # a call was made: read its response
        response = _RESPONSE.search(messages[-1]["content"])
        if response and _NUMBER.fullmatch(response.group(1)):
            return response.group(1)
    question = next((m["content"] for m in messages if m["role"] == "user"), "")
    asked = _QUESTION.search(question)
    return tool_call(asked.group(1) if asked else str(task.get("key", "")))


def careless_player(task: dict[str, Any], messages: list[dict[str, str]]) -> str:
    """``lookup_player`` that answers a guess without looking on a third of its episodes: demonstrations that
    teach the format and the tool but not always to use it, leaving GRPO the rest."""
    if len(messages) < 2 or messages[-2]["role"] != "assistant":
        if _CARELESS.random() < 1 / 3:
            return str(_CARELESS.randint(10, 99))
    return lookup_player(task, messages)
