"""KeyLookup as a ``verifiers`` tool environment, written with the library's own API: a ``StatefulToolEnv``
whose ``lookup(key)`` tool reads the row's hidden table (passed to the tool by ``update_tool_args``, never shown
to the model), scored by a ``Rubric`` (``correct``: the final reply is the key's value).

``load_environment(num_train, num_eval, seed)`` builds it (``env.verifiers.id:
rlfabric.envs.vf_key_lookup:load_environment``); rows are KeyLookup's tasks (``rlfabric.tasks``), the question
``Value of key xy?``, the table in the row's ``info``; ``lookup_player`` plays it for a warm-up. The library
sends the tool's schema with every call (OpenAI ``tools``), reads the model's tool calls from the endpoint's
replies, runs the tool and sends its result as a ``tool`` message, until a reply has no call or ``max_turns`` is
reached. This module imports ``verifiers`` only inside ``load_environment``: the driver, which does not have the
library, imports the scripted player.
"""

from __future__ import annotations

import re
from typing import Any

from rlfabric.envs.key_lookup import tool_call
from rlfabric.tasks import key_lookup_rows

_QUESTION = re.compile(r"Value of key (\S+)\?")


def lookup_player(task: dict[str, Any], messages: list[dict[str, Any]]) -> str:
    """The warm-up's scripted answers (``sft.player``): call ``lookup`` on the key the question names, then copy
    the tool's result."""
    last = messages[-1]
    if last["role"] == "tool" and not last["content"].startswith("error"):
        return last["content"]
    asked = next((_QUESTION.search(m["content"]) for m in messages if m["role"] == "user"), None)
    return tool_call(asked.group(1) if asked else "")


def correct(completion: Any, answer: str, **kwargs: Any) -> float:
    """1 when the last reply, stripped (``xy=mt`` read as ``mt``), is the key's value."""
    text = str(completion[-1]["content"] or "") if completion else ""
    return float(text.strip().rsplit("=", 1)[-1].strip() == str(answer))


def lookup(key: str, table: dict) -> str:
    """The value stored under a key of the table.

    Args:
        key: the key to look up
    """
    return str(table[key]) if key in table else f"error: no key {key}"


def load_environment(num_train: int = 200, num_eval: int = 20, seed: int = 0, max_turns: int = 3) -> Any:
    """The environment: see the module docstring."""
    import verifiers as vf
    from datasets import Dataset

    class KeyLookupTools(vf.StatefulToolEnv):
        def update_tool_args(self, tool_name: str, tool_args: dict, messages: Any, state: Any, **kwargs: Any) -> dict:
            return {**tool_args, "table": state["info"]["table"]}  # the row's table, hidden from the model

    rows = key_lookup_rows(num_train + num_eval, seed=seed)

    def dataset(part: list[dict[str, Any]]) -> Any:
        return Dataset.from_list(
            [
                {"question": f"Value of key {r['key']}?", "answer": r["table"][r["key"]], "info": {"table": r["table"]}}
                for r in part
            ]
        )

    env = KeyLookupTools(
        dataset=dataset(rows[:num_train]),
        eval_dataset=dataset(rows[num_train:]),
        rubric=vf.Rubric(funcs=[correct]),
        max_turns=max_turns,
    )
    env.add_tool(lookup, args_to_skip=["table"])
    return env
