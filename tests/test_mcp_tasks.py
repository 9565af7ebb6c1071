"""McpTasks: agent episodes on the stateful MCP task servers, end to end through the real protocol. Tasks drawn
from the live state of fresh sessions (``task:mcp``), solved by the scripted solver and verified on the final
state; a wrong answer, a wrong change and bad calls scored as such; state keys equal exactly when the states are;
supervised servers free each episode's state when it ends; the CLI lists and checks the servers."""

from __future__ import annotations

import asyncio

import pytest
import ray

from rlfabric.actors.tool_server import ToolServer
from rlfabric.agent_loop import EpisodeLimits, ScriptedTurns, run_episodes
from rlfabric.cli import main
from rlfabric.config import ConfigError, config_from_dict
from rlfabric.data import load_prompts
from rlfabric.envs.mcp_tasks import McpTaskEnv, solution_player, tool_call_text, wasteful_player
from rlfabric.envs.task_library import TASK_SERVERS
from rlfabric.llm_text_env import tool_server_commands
from rlfabric.mcp_tools import McpSession
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import TOOL_ALPHABET, build_char_tokenizer

CHAT = ChatTokens(build_char_tokenizer(TOOL_ALPHABET))
LIMITS = EpisodeLimits(max_turns=6, turn_tokens=512, max_episode_tokens=16384, step_timeout_s=30.0)
SPEC = "task:mcp?servers=notes,bank&min_calls=1&max_calls=2"


def play(tasks: list[dict], player, **env_kwargs) -> list:
    turns = ScriptedTurns(player, CHAT)
    return asyncio.run(run_episodes(lambda: McpTaskEnv(**env_kwargs), tasks, turns, CHAT, LIMITS))


def test_tasks_come_from_the_named_servers_interleaved_and_repeat_for_a_seed():
    rows = load_prompts(SPEC, num_rows=6, seed=3)
    assert [r["server"] for r in rows] == ["notes", "bank"] * 3  # any prefix mixes the servers
    assert {r["calls"] for r in rows} <= {1, 2}
    assert all(len(r["solution"]["calls"]) == r["calls"] for r in rows)
    assert len({r["prompt"] for r in rows}) == 6 and all(r["question"] in r["prompt"] for r in rows)
    assert load_prompts(SPEC, num_rows=6, seed=3) == rows
    for spec, says in [
        ("task:mcp?servers=notes,atm", "'atm' is not a task server"),
        ("task:mcp?servers=bank&min_calls=3&max_calls=2", "1 <= min <= max"),
    ]:
        with pytest.raises(ConfigError, match=says):
            load_prompts(spec, num_rows=2)


def test_the_scripted_solver_is_verified_and_wrong_answers_changes_and_calls_are_scored():
    tasks = list(load_prompts("task:mcp?servers=bank&min_calls=2&max_calls=2", num_rows=8, seed=1))
    asked = next(t for t in tasks if t["solution"]["answer"] != "done")  # "Balance of bo?"
    change = next(t for t in tasks if t["solution"]["answer"] == "done")  # "Send 5 from a2 to bo"

    def wrong_answer(task: dict, messages: list[dict]) -> str:
        reply = solution_player(task, messages)
        return reply if reply.startswith("<tool_call>") else "1000"

    def bad_calls_then_skip_the_change(task: dict, messages: list[dict]) -> str:
        done = sum(m["role"] == "assistant" for m in messages)
        bad = ['<tool_call>{"name": "transfer"</tool_call>', tool_call_text({"name": "rob", "arguments": {}})]
        return bad[done] if done < 2 else "done"  # malformed, unknown tool, then claims done without transferring

    solved = play([asked, change], solution_player, servers="bank")
    assert [e.rewards["correct"] for e in solved] == [1.0, 1.0], [e.error for e in solved]
    assert [e.rewards["calls"] for e in solved] == [2.0, 2.0] and solved[0].rewards["invalid"] == 0.0
    wrong = play([asked], wrong_answer, servers="bank")[0]
    assert wrong.error is None and wrong.rewards["correct"] == 0.0
    skipped = play([change], bad_calls_then_skip_the_change, servers="bank")[0]
    assert skipped.rewards["correct"] == 0.0  # the state lacks the transfer the task asked for
    assert skipped.rewards["invalid"] == 2.0 and skipped.invalid_tool_calls == {"malformed": 1, "unknown_tool": 1}


def test_state_keys_are_equal_exactly_when_the_session_states_and_the_agents_views_are():
    task = next(t for t in load_prompts("task:mcp?servers=notes", num_rows=4, seed=2) if t["calls"] == 1)
    lookup = tool_call_text(task["solution"]["calls"][0])  # a get: the server's state stays as it was
    write = tool_call_text({"name": "put", "arguments": {"key": "zz", "value": "new"}})

    async def keys() -> list[str]:
        envs = [McpTaskEnv("notes") for _ in range(5)]
        try:
            for env in envs:
                await env.reset(task)
            before = [await env.state_key() for env in envs]
            for env, action in zip(envs[1:], [write, write, lookup, lookup], strict=True):
                await env.step(action)
            return before + [await env.state_key() for env in envs]
        finally:
            for env in envs:
                await env.close()

    before, after = (lambda k: (k[:5], k[5:]))(asyncio.run(keys()))
    assert len(set(before)) == 1 and after[0] == before[0]  # fresh sessions on one seed, one question
    assert after[1] == after[2] != before[0]  # the same write gives the same state, and a new one
    assert after[3] == after[4] != before[0]  # a lookup: the same server state, but the agent now sees the value
    assert after[3].split("/")[0] == before[0].split("/")[0] != after[1].split("/")[0]


def test_the_wasteful_players_solved_episodes_differ_only_in_repeated_calls():
    tasks = [t for t in load_prompts("task:mcp?servers=notes", num_rows=24, seed=3) if t["calls"] == 1]
    episodes = play(tasks, wasteful_player, servers="notes")
    solved = [e for e in episodes if e.rewards["correct"] == 1.0]
    assert all(e.error is None for e in episodes)
    assert {e.rewards["calls"] for e in solved} == {1.0, 2.0}, [e.rewards for e in episodes]
    assert {e.rewards["calls"] for e in episodes if e.rewards["correct"] == 0.0} == {0.0}  # only guesses fail
    assert all(e.rewards["invalid"] == 0.0 and e.rewards["failed_calls"] == 0.0 for e in episodes)


def test_supervised_servers_serve_episodes_and_free_each_sessions_state(local_ray):
    tasks = load_prompts(SPEC, num_rows=8, seed=5)
    servers = {n: ToolServer.remote(n, TASK_SERVERS[n].http_command) for n in ("notes", "bank")}
    urls = ray.get([s.start.remote() for s in servers.values()])
    episodes = play(tasks, solution_player, servers=["notes", "bank"], tool_servers=servers)
    assert [e.rewards.get("correct") for e in episodes] == [1.0] * 8, [e.error for e in episodes]

    async def live_sessions(url: str) -> int:
        session = await McpSession.open(url)
        try:
            return int(await session.call("env_sessions"))
        finally:
            await session.close()

    assert [asyncio.run(live_sessions(url)) for url in urls] == [0, 0]  # every episode's state was freed
    ray.get([s.stop.remote() for s in servers.values()])


def test_the_cli_lists_the_task_servers_and_checks_one_with_its_scripted_solver(capsys):
    assert main(["envs", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in TASK_SERVERS) and len(TASK_SERVERS) >= 6
    assert main(["tools", "check", "notes", "--tasks", "2"]) == 0
    out = capsys.readouterr().out
    levels = [line for line in out.splitlines() if " calls: " in line]
    spec = TASK_SERVERS["notes"]
    assert len(levels) == spec.max_calls - spec.min_calls + 1 and all("2/2 solved" in line for line in levels)
    assert out.strip().endswith("OK notes")
    assert main(["tools", "check", "atm"]) == 1
    assert "not a task server" in capsys.readouterr().err
    assert main(["tools", "list", "bank"]) == 0
    assert "transfer(from_account: string, to_account: string, amount: integer)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("tool_servers", "says"),
    [
        ({"mine": 3}, r"env.tool_servers = \{'mine': 3\} is not valid"),
        ({"": "my-mcp-server"}, r"env.tool_servers = \{'': 'my-mcp-server'\} is not valid"),
        ("notes", r"env.tool_servers = 'notes' is not valid"),
    ],
)
def test_a_bad_tool_servers_value_is_one_error_naming_the_field(tool_servers, says):
    config = {"algo": "grpo", "env": {"id": "rlfabric/McpTasks-v0", "tool_servers": tool_servers}, "sft": {"steps": 0}}
    with pytest.raises(ConfigError, match=says):
        config_from_dict({**config, "rewards": {"functions": []}})


def test_a_stdio_command_is_a_valid_tool_server():
    servers = {"notes": "python -m rlfabric.envs.notes_server", "web": "my-server --port {port}"}
    config = {"algo": "grpo", "env": {"id": "rlfabric/McpTasks-v0", "tool_servers": servers}, "sft": {"steps": 0}}
    assert config_from_dict({**config, "rewards": {"functions": []}}).env.tool_servers == servers


def test_an_unknown_shipped_server_name_is_one_error_listing_them():
    assert tool_server_commands(["notes"]) == {"notes": TASK_SERVERS["notes"].http_command}
    with pytest.raises(ConfigError, match=r"'atm' is not a shipped task server \(notes, bank"):
        tool_server_commands(["atm"])
