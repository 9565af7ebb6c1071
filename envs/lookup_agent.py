"""An outside agent with a tool of its own, written against the plain ``openai`` client: KeyLookup as an agent.

``lookup_agent(task, client)`` is what an agent author writes: it asks the model ``Value of key xy?`` with a
``lookup`` tool described in OpenAI's format, runs the tool itself on the task's table when the model calls it
(the model never sees the table), sends the result back as a ``tool`` message, and scores the model's first
answer without a call: ``correct`` 1 when it is the key's value. Nothing in it knows rlfabric: the run hands it a
client whose calls are the policy's turns, recorded token for token (``rlfabric.agent_rollout``).

``careless_player`` answers the agent's calls for the warm-up's demonstrations (``sft.player``): it calls
``lookup`` on the key asked for and copies the tool's result, except that on a third of its episodes it answers a
guess without looking, so the warm-up teaches the call and the copy and leaves using the tool to GRPO. The task
rows are KeyLookup's (``data.train: task:key_lookup``); the builtin model needs ``model.builtin.alphabet: tool``.
Example: ``examples/openai_agent_grpo.yaml``.
"""

from __future__ import annotations

import json
import random
import string
from typing import Any

from rlfabric.envs.key_lookup import tool_call

MAX_CALLS = 3  # a call, the answer, and one more call after a bad one
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The value stored under a key of the table.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}
_CARELESS = random.Random(0)  # the careless player's slips: seeded, so a run's demonstrations repeat


def lookup(table: dict[str, str], arguments: str) -> str:
    """The tool: the value under the call's ``key``, or an error the model is shown."""
    try:
        key = json.loads(arguments)["key"]
    except (ValueError, KeyError, TypeError):
        return "error: expected arguments {key}"
    return table[key] if key in table else f"error: no key {key}"


async def lookup_agent(task: dict[str, Any], client: Any) -> dict[str, float]:
    """One KeyLookup episode driven through ``client`` (an ``openai.AsyncOpenAI``): see the module docstring."""
    table = {str(k): str(v) for k, v in task["table"].items()}
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Value of key {task['key']}?"}]
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP_TOOL])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            said = (message.content or "").strip().rsplit("=", 1)[-1].strip()  # "mt" or "xy=mt"
            return {"correct": float(said == table[task["key"]])}
        for call in message.tool_calls:
            result = lookup(table, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"correct": 0.0}


def lookup_player(task: dict[str, Any], messages: list[dict[str, Any]]) -> str:
    """The perfect scripted answers: call ``lookup`` on the key asked for, then copy the tool's result (or call
    again after an error)."""
    last = messages[-1]
    if last["role"] == "tool" and not last["content"].startswith("error"):
        return last["content"]
    return tool_call(str(task["key"]))


def careless_player(task: dict[str, Any], messages: list[dict[str, Any]]) -> str:
    """``lookup_player`` that answers a guess without looking on a third of its episodes (the example's warm-up)."""
    if messages[-1]["role"] != "tool" and _CARELESS.random() < 1 / 3:
        return "".join(_CARELESS.choice(string.ascii_lowercase) for _ in range(2))
    return lookup_player(task, messages)
