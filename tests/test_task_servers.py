"""The shipped stateful MCP task servers, through the real protocol: tasks sampled from the live state name only
what exists, their solutions replayed on a fresh session pass the verifier, wrong answers and extra or missing
changes fail it (hand-written cases), sessions on one HTTP process are isolated and freed by env_close, the
records server refuses anything but SELECT, and sampling is deterministic."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import random
import re
import time

import pytest
from http_servers import module_over_http

from rlfabric.envs import bank_server, calendar_server, files_server, notes_server, records_server, shop_server
from rlfabric.envs.task_library import TASK_SERVERS, sample_tasks, task_server
from rlfabric.envs.task_server import CONTROL_PREFIX, TaskServer, state_digest
from rlfabric.grpo_config import TOOL_ALPHABET
from rlfabric.mcp_tools import McpSession, McpToolError

AGENT_TOOLS = {
    "notes": {"put", "get", "delete", "keys"},
    "bank": {"find_account", "balance", "transfer", "history"},
    "shop": {"stock", "price", "place_order", "cancel_order", "list_orders"},
    "calendar": {"list_day", "find_event", "create_event", "move_event", "delete_event"},
    "records": {"query", "update_team"},
    "files": {"list_dir", "read_file", "write_file", "move", "delete"},
}
CONTROL_TOOLS = {"env_reset", "env_state", "env_digest", "env_close", "env_sessions"}


def existing_names(server: str, state: dict) -> set[str]:
    """The names of the entities in a server's state, read straight from its JSON form."""
    if server == "notes":
        return set(state["notes"])
    if server == "bank":
        return set(state["accounts"]) | {a["owner"] for a in state["accounts"].values()}
    if server == "shop":
        return set(state["items"])
    if server == "calendar":
        return {e["title"] for e in state["events"].values()}
    if server == "records":
        return {p["name"] for p in state["people"]} | {t["name"] for t in state["teams"]}
    paths = set(state["files"])
    return paths | {path.rsplit("/", 1)[0] for path in paths if "/" in path}


VOCABULARY = {
    "notes": set(notes_server.KEYS),
    "bank": set(bank_server.OWNERS) | {f"a{i}" for i in range(1, 10)},
    "shop": set(shop_server.ITEMS),
    "calendar": set(calendar_server.TITLES),
    "records": set(records_server.PEOPLE) | set(records_server.TEAMS),
    "files": set(files_server.DIRS),
}
CREATING = {"put": "key", "create_event": "title", "write_file": "path", "move": "dst"}


def check_names(task: dict, state: dict) -> None:
    """Every entity the question names exists in ``state``, but for the one the task asks to create (whose
    directory, for a file, exists)."""
    names = existing_names(task["server"], state)
    created = {c["arguments"][CREATING[c["name"]]] for c in task["solution"]["calls"] if c["name"] in CREATING}
    for token in re.findall(r"[a-z0-9/]+", task["question"].lower()):
        if "/" in token:
            assert token in names or (token in created and token.rsplit("/", 1)[0] in names), (token, task)
        elif token in VOCABULARY[task["server"]]:
            assert token in names or token in created, (token, task)
    assert created.isdisjoint(names), task  # what a task creates is new


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def check_dependent(task: dict, results: list[str]) -> None:
    """With 2+ calls, some later call passes on what an earlier one returned and the question does not say."""
    calls = task["solution"]["calls"]
    if len(calls) < 2:
        return
    carried = [
        words(json.dumps(call["arguments"])) & words(" ".join(results[:j])) - words(task["question"])
        for j, call in enumerate(calls)
    ]
    assert any(carried[1:]), task


async def replay(session: McpSession, task: dict) -> tuple[list[str], dict]:
    """Reset the session to the task's seed, run its solution calls; their results and the final state."""
    await session.call("env_reset", {"seed": task["seed"]})
    results = [await session.call(c["name"], c["arguments"]) for c in task["solution"]["calls"]]
    return results, json.loads(await session.call("env_state"))


@pytest.mark.parametrize("name", list(TASK_SERVERS))
def test_sampled_tasks_of_every_difficulty_name_live_entities_and_their_solutions_verify(name):
    spec = task_server(name)
    levels = list(range(spec.min_calls, spec.max_calls + 1))

    async def scenario() -> None:
        # the replay session is a second process (a fresh session, not the sampler's), started meanwhile
        opening = asyncio.create_task(McpSession.open(spec.command))
        try:
            tasks = await sample_tasks(spec, 10 * len(levels), seed=7, calls=(spec.min_calls, spec.max_calls))
        finally:
            session = await opening
        try:
            assert sorted({task["calls"] for task in tasks}) == levels  # every difficulty drawn
            assert {tool.name for tool in session.listed} == AGENT_TOOLS[name] | CONTROL_TOOLS
            for task in tasks:
                assert task["server"] == name and len(task["solution"]["calls"]) == task["calls"]
                assert len(task["question"]) <= 60 and all(
                    c["name"] in AGENT_TOOLS[name] for c in task["solution"]["calls"]
                )
                await session.call("env_reset", {"seed": task["seed"]})
                state = json.loads(await session.call("env_state"))
                assert state == spec.initial_state(task["seed"])  # the live state is the seed's
                check_names(task, state)
                results, final = await replay(session, task)
                check_dependent(task, results)
                texts = [task["question"], task["solution"]["answer"], json.dumps(task["solution"]["calls"]), *results]
                assert set("".join(texts)) <= set(TOOL_ALPHABET), texts  # a character-level model can read it all
                answer = task["solution"]["answer"]
                assert spec.verify(task, final, answer), (task, results, final)
                digest = await session.call("env_digest")
                assert digest == hashlib.sha256((await session.call("env_state")).encode()).hexdigest()[:16]
                if task["goal"]["answer"] is None:  # a change: the untouched state misses it
                    assert answer == "done" and not spec.verify(task, state, answer)
                else:  # a question: a wrong answer fails, case and spaces do not matter
                    assert not spec.verify(task, final, answer + "x")
                    assert spec.verify(task, final, f"  {answer.upper()} ")
        finally:
            await session.close()

    asyncio.run(scenario())


def task_asking(spec: TaskServer, state: dict, calls: int, question: str) -> dict:
    """The task ``make_task`` draws for ``question`` on ``state`` (tried over rng seeds); ``state`` stays as it was."""
    before = copy.deepcopy(state)
    for seed in range(2000):
        task = spec.make_task(state, random.Random(seed), calls)
        assert state == before  # the generator only reads the live state
        if task["question"] == question:
            return task
    raise AssertionError(f"{spec.name} never asked {question!r}")


def changed(state: dict, path: tuple, value: object) -> dict:
    """A copy of ``state`` with the value at ``path`` replaced (None deletes the key)."""
    out = copy.deepcopy(state)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


def test_notes_verifier_hand_written_cases():
    spec, state = TASK_SERVERS["notes"], {"notes": {"cat": "red", "dog": "blue"}}
    lookup = task_asking(spec, state, 1, "Note cat?")
    assert lookup["solution"] == {"calls": [{"name": "get", "arguments": {"key": "cat"}}], "answer": "red"}
    assert spec.verify(lookup, state, "red") and spec.verify(lookup, state, " Red\n")
    assert not spec.verify(lookup, state, "blue")
    assert not spec.verify(lookup, {"notes": {"cat": "red", "dog": "gold"}}, "red")  # a change nobody asked for
    rename = task_asking(spec, state, 3, "Rename note cat to owl")
    assert spec.verify(rename, {"notes": {"dog": "blue", "owl": "red"}}, "done")
    assert not spec.verify(rename, {"notes": {"cat": "red", "dog": "blue", "owl": "red"}}, "done")  # not deleted
    assert not spec.verify(rename, {"notes": {"dog": "blue", "owl": "red", "sun": "x"}}, "done")  # an extra note
    assert not spec.verify(rename, {"notes": {"dog": "blue", "owl": "blue"}}, "done")  # the wrong value


def test_bank_verifier_hand_written_cases():
    spec = TASK_SERVERS["bank"]
    state = {"accounts": {"a1": {"owner": "ana", "balance": 10}, "a2": {"owner": "bo", "balance": 20}}, "log": []}
    balance = task_asking(spec, state, 1, "Balance of a2?")
    assert spec.verify(balance, state, "20") and not spec.verify(balance, state, "10")
    send = task_asking(spec, state, 3, "Send 5 from bo to ana")
    paid = {
        "accounts": {"a1": {"owner": "ana", "balance": 15}, "a2": {"owner": "bo", "balance": 15}},
        "log": [{"from": "a2", "to": "a1", "amount": 5}],
    }
    assert spec.verify(send, paid, "done")
    assert not spec.verify(send, changed(paid, ("log",), []), "done")  # no record of the transfer
    assert not spec.verify(send, changed(paid, ("accounts", "a2", "balance"), 20), "done")  # bo not debited
    assert not spec.verify(send, changed(paid, ("accounts", "a1", "owner"), "cy"), "done")  # an extra change
    assert not spec.verify(send, state, "done")
    then = task_asking(spec, state, 4, "Send 5 from bo to ana, then balance of ana?")
    assert spec.verify(then, paid, "15") and not spec.verify(then, paid, "10") and not spec.verify(then, state, "15")


def test_shop_verifier_hand_written_cases():
    spec = TASK_SERVERS["shop"]
    state = {
        "items": {"pen": {"stock": 4, "price": 2}, "cup": {"stock": 1, "price": 5}},
        "orders": {"o1": {"item": "cup", "qty": 2}},
        "next_order": 2,
    }
    assert spec.verify(task_asking(spec, state, 1, "Stock of pen?"), state, "4")
    cancel = task_asking(spec, state, 2, "Cancel the cup order")
    cancelled = changed(changed(state, ("orders", "o1"), None), ("items", "cup", "stock"), 3)
    assert spec.verify(cancel, cancelled, "done")
    assert not spec.verify(cancel, changed(state, ("orders", "o1"), None), "done")  # the stock not put back
    assert not spec.verify(cancel, changed(cancelled, ("items", "pen", "stock"), 3), "done")  # a pen gone too
    resized = task_asking(spec, state, 3, "Change the cup order to 3")
    after = {
        "items": {"pen": {"stock": 4, "price": 2}, "cup": {"stock": 0, "price": 5}},
        "orders": {"o2": {"item": "cup", "qty": 3}},
        "next_order": 3,
    }
    assert spec.verify(resized, after, "done")
    assert not spec.verify(resized, changed(after, ("orders", "o2", "qty"), 2), "done")


def test_calendar_verifier_hand_written_cases():
    spec = TASK_SERVERS["calendar"]
    state = {
        "events": {"e1": {"title": "gym", "day": 1, "hour": 9}, "e2": {"title": "call", "day": 2, "hour": 10}},
        "next_event": 3,
    }
    day = task_asking(spec, state, 1, "Day of call?")
    assert spec.verify(day, state, "2") and not spec.verify(day, state, "10")
    delete = task_asking(spec, state, 2, "Delete gym")
    assert spec.verify(delete, changed(state, ("events", "e1"), None), "done")
    assert not spec.verify(delete, {"events": {}, "next_event": 3}, "done")  # call deleted too
    assert not spec.verify(delete, state, "done")
    moved = task_asking(spec, state, 3, "Move gym to call's day at 15")
    assert not spec.verify(moved, changed(state, ("events", "e1", "day"), 2), "done")  # the hour still 9
    assert spec.verify(moved, changed(changed(state, ("events", "e1", "day"), 2), ("events", "e1", "hour"), 15), "done")


def test_records_verifier_hand_written_cases():
    spec = TASK_SERVERS["records"]
    state = {
        "people": [
            {"name": "ana", "team": "red", "age": 30},
            {"name": "bo", "team": "blue", "age": 40},
            {"name": "cy", "team": "blue", "age": 20},
        ],
        "teams": [{"name": "blue", "room": 2}, {"name": "red", "room": 1}],
    }
    assert spec.verify(task_asking(spec, state, 2, "Room of ana's team?"), state, "1")
    join = task_asking(spec, state, 2, "Move ana to bo's team")
    joined = changed(state, ("people", 0, "team"), "blue")
    assert spec.verify(join, joined, "done")
    assert not spec.verify(join, changed(joined, ("people", 2, "team"), "red"), "done")  # cy moved too
    assert not spec.verify(join, changed(joined, ("people", 0, "age"), 31), "done")
    count = task_asking(spec, state, 3, "Move ana to bo's team, how many in it?")
    assert spec.verify(count, joined, "3") and not spec.verify(count, joined, "2")


def test_files_verifier_hand_written_cases():
    spec = TASK_SERVERS["files"]
    state = {"files": {"docs/todo": "milk", "tmp/plan": "go"}}
    assert spec.verify(task_asking(spec, state, 1, "Read docs/todo"), state, "milk")
    copied = task_asking(spec, state, 3, "Copy the file in docs to tmp")
    assert spec.verify(copied, {"files": {"docs/todo": "milk", "tmp/plan": "go", "tmp/todo": "milk"}}, "done")
    assert not spec.verify(copied, {"files": {"tmp/plan": "go", "tmp/todo": "milk"}}, "done")  # moved, not copied
    assert not spec.verify(copied, {"files": {"docs/todo": "milk", "tmp/plan": "go", "tmp/todo": "eggs"}}, "done")


def test_records_refuses_anything_but_a_select():
    async def scenario() -> None:
        session = await McpSession.open(TASK_SERVERS["records"].command)
        try:
            await session.call("env_reset", {"seed": 3})
            before = await session.call("env_state")
            for sql, says in [
                ("DELETE FROM people", "only SELECT queries are allowed, got 'DELETE FROM people'"),
                ("UPDATE people SET age = 1", "only SELECT queries are allowed"),
                ("SELECT 1; DROP TABLE people", "bad query"),
                ("SELECT nope FROM people", "bad query: no such column: nope"),
            ]:
                with pytest.raises(McpToolError, match=re.escape(says)):
                    await session.call("query", {"sql": sql})
            assert await session.call("env_state") == before
            people = json.loads(before)["people"]
            assert await session.call("query", {"sql": "select count(*) from people"}) == str(len(people))
        finally:
            await session.close()

    asyncio.run(scenario())


@pytest.fixture
def bank_over_http():
    """The bank server serving streamable HTTP in its own process; its URL."""
    with module_over_http("rlfabric.envs.bank_server") as url:
        yield url


def test_http_sessions_hold_their_own_state_and_env_close_frees_it(bank_over_http):
    spec = TASK_SERVERS["bank"]

    async def scenario() -> None:
        one, two = await McpSession.open(bank_over_http), await McpSession.open(bank_over_http)
        try:
            assert await one.call("env_sessions") == "0"  # nothing held before a session touches its state
            await one.call("env_reset", {"seed": 1})
            await two.call("env_reset", {"seed": 2})
            assert json.loads(await one.call("env_state")) == spec.initial_state(1)
            assert json.loads(await two.call("env_state")) == spec.initial_state(2)
            payer = next(a for a, r in spec.initial_state(1)["accounts"].items() if r["balance"] >= 3)
            await one.call(
                "transfer", {"from_account": payer, "to_account": "a1" if payer != "a1" else "a2", "amount": 3}
            )
            assert json.loads(await two.call("env_state")) == spec.initial_state(2)  # not two's business
            assert json.loads(await one.call("env_state")) != spec.initial_state(1)
            assert await two.call("env_sessions") == "2"
            assert await one.call("env_close") == "ok"
            assert await two.call("env_sessions") == "1"  # one's state is gone from the server
            assert json.loads(await one.call("env_state")) == spec.initial_state(0)  # a fresh one if used again
            await one.call("env_close")
            three = await McpSession.open(bank_over_http)
            await three.call("env_reset", {"seed": 3})
            assert await two.call("env_sessions") == "2"
            await three.close()  # ends its HTTP session without env_close: the server frees the state anyway
            deadline = time.monotonic() + 10.0
            while await two.call("env_sessions") != "1" and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert await two.call("env_sessions") == "1"
            with pytest.raises(McpToolError, match="no account 'zz'"):
                await two.call("balance", {"account": "zz"})
            # sampling through the URL: deterministic, and it frees the state of its own session
            first = await sample_tasks(spec, 5, seed=3, calls=(1, 4), url=bank_over_http)
            assert first == await sample_tasks(spec, 5, seed=3, calls=(1, 4), url=bank_over_http)
            assert first != await sample_tasks(spec, 5, seed=4, calls=(1, 4), url=bank_over_http)
            assert [sorted(task) for task in first] == [["calls", "goal", "question", "seed", "server", "solution"]] * 5
            assert await two.call("env_sessions") == "1"
        finally:
            await one.close()
            await two.close()

    asyncio.run(scenario())


def test_protocol_pieces():
    assert CONTROL_PREFIX == "env_"
    assert state_digest({"b": [2, {"c": "x"}], "a": 1}) == hashlib.sha256(b'{"a":1,"b":[2,{"c":"x"}]}').hexdigest()[:16]
    assert set(TASK_SERVERS) == {"notes", "bank", "shop", "calendar", "records", "files"}
    assert task_server("bank").command == "python -m rlfabric.envs.bank_server"
    with pytest.raises(ValueError, match="unknown task server 'nope'; known: bank, calendar, files, notes"):
        task_server("nope")
    with pytest.raises(ValueError, match=r"calls for the notes server must lie in 1\.\.3, got 4"):
        asyncio.run(sample_tasks(task_server("notes"), 1, 0, 4))
    with pytest.raises(ValueError, match=r"bank: calls must be in 1\.\.4, got 5"):
        task_server("bank").make_task(task_server("bank").initial_state(0), random.Random(0), 5)
    for spec in TASK_SERVERS.values():  # initial states: deterministic in the seed, and seeds differ
        assert spec.initial_state(5) == spec.initial_state(5) != spec.initial_state(6)
