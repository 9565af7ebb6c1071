"""A GRPO run's warm-up on a text env whose MCP tool server is broken: its tool raises or hangs. The
demonstrations' calls all come back as errors; the warm-up says so as it happens (the first error of each kind,
with counts, and that every call failed), and the agent reads the server's own words, not rlfabric's class names."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grpo_runs import run_grpo

from rlfabric.registry import register_env
from rlfabric.text_env import TextStep
from rlfabric.tool_env import McpToolEnv

# tests/mcp_test_server.py over stdio: `crash` raises, `wait` sleeps as long as it is asked
FAULTY = f"{sys.executable} {Path(__file__).parent / 'mcp_test_server.py'}"


class AnyAnswer:
    def reset(self, task: dict) -> str:
        return "Call crash, then wait, then answer."

    def answer(self, text: str) -> TextStep:
        return TextStep("", {"correct": 0.0}, terminated=True)


def faulty_tools_env(tool_servers=None):
    """The factory shape docs/agents.md shows: the run's supervised server when it hands one, else a process of
    its own per episode (the check before the servers start)."""
    return McpToolEnv(AnyAnswer(), (tool_servers or {}).get("faulty", FAULTY), tool_timeout_s=5.0)


def crash_then_hang_player(task: dict, messages: list[dict[str, str]]) -> str:
    calls = [{"name": "crash", "arguments": {}}, {"name": "wait", "arguments": {"seconds": 30}}]
    done = sum(m["role"] == "assistant" for m in messages)
    return f"<tool_call>{json.dumps(calls[done])}</tool_call>" if done < len(calls) else "x"


def test_a_warm_up_whose_tool_calls_all_fail_says_so_with_the_servers_words(local_ray, tmp_path):
    register_env("faulty-tools", faulty_tools_env)
    run = run_grpo(
        tmp_path / "run",
        quiet=False,
        model={
            "builtin": {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "max_positions": 512, "alphabet": "tool"}
        },
        data={"train": "task:guess_number?min_high=4&max_high=10", "num_train": 8, "num_eval": 2},
        env={"id": "faulty-tools", "max_turns": 3, "step_timeout_s": 20.0, "tool_servers": {"faulty": FAULTY}},
        rewards={"functions": []},
        sampling={"max_new_tokens": 8},
        sft={"steps": 2, "batch_size": 4, "player": "test_mcp_training_faults:crash_then_hang_player"},
        training={"total_steps": 1, "eval_every": 0, "show_samples": 0},
    )
    notes = [line for line in run.console.splitlines() if line.startswith("rlfabric: sft.player: ")]
    crashed = [n for n in notes if "tool call failed (tool_error)" in n]
    hung = [n for n in notes if "tool call failed (tool_timeout)" in n]
    every = [n for n in notes if "every tool call of the 4 demonstration episodes so far failed (8 calls)" in n]
    assert len(crashed) == len(hung) == len(every) == 1, notes  # the first of each kind, once
    # what the agent was shown: the server's own words (the SDK's server keeps a raising tool's message to itself),
    # without rlfabric's exception class
    assert "(tool_error): error: crash: Error executing tool crash (4 of 8 calls so far;" in crashed[0], notes
    assert "error: wait did not answer within 5s" in hung[0] and "McpToolError" not in run.console
    assert len(run.phase("sft")) == 2 and run.summary["tool_server_restarts"] == 0
