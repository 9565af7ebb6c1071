"""Records in sqlite as a stateful MCP task server: an in-memory database per session, built from the seed.

Tables ``people(name, team, age)`` and ``teams(name, room)``. Tools: ``query(sql)`` runs one read-only SELECT
(anything else is refused, with the reason) and ``update_team(person, team)`` moves a person to an existing team.
``env_state`` dumps both tables as JSON (rows ordered by name). Serve it with ``python -m
rlfabric.envs.records_server`` (stdio) or ``--http PORT``.

Tasks, by number of calls: 1 "Team of ana?" or "Room of red?" (one query) or "Move ana to blue" (update_team);
2 "Move ana to bo's team" (query, update_team) or "Room of ana's team?" (two queries); 3 "Move ana to bo's team,
how many in it?" (query, update_team, a count).

Everything the agent reads and writes keeps to the built-in character tokenizer's tool alphabet (rows as lines,
columns separated by ', '; no '|' or ';').
"""

from __future__ import annotations

import random
import re
import sqlite3

from mcp.server.mcpserver.exceptions import ToolError

from rlfabric.envs.task_server import (
    build_task_server,
    call,
    serve,
    solved_task,
)

PEOPLE = ["ana", "bo", "cy", "dee", "eli", "fay", "gus", "hal", "ivy", "jo", "kai", "lu", "max", "ned"]
TEAMS = ["red", "blue", "green", "gold", "gray", "pink"]
SCHEMA = (
    "CREATE TABLE people (name TEXT PRIMARY KEY, team TEXT NOT NULL, age INTEGER NOT NULL);"
    "CREATE TABLE teams (name TEXT PRIMARY KEY, room INTEGER NOT NULL);"
)
SELECT = re.compile(r"\s*select\b", re.IGNORECASE)


def initial_state(seed: int) -> dict:
    """3 teams from ``TEAMS`` in distinct rooms 1-9 and 5-8 people from ``PEOPLE`` (age 18-65), each team with at
    least one of them, drawn by ``random.Random(seed)``: the tables as JSON, rows ordered by name."""
    rng = random.Random(seed)
    teams = sorted(rng.sample(TEAMS, 3))
    rooms = rng.sample(range(1, 10), 3)
    people = rng.sample(PEOPLE, rng.randint(5, 8))
    team_of = {name: teams[i] if i < len(teams) else rng.choice(teams) for i, name in enumerate(people)}
    return {
        "people": [{"name": name, "team": team_of[name], "age": rng.randint(18, 65)} for name in sorted(people)],
        "teams": [{"name": name, "room": room} for name, room in zip(teams, rooms, strict=True)],
    }


def load(state: dict) -> dict:
    """A session's live state: ``{"db": an in-memory sqlite3 connection}`` holding ``state``'s tables."""
    db = sqlite3.connect(":memory:")
    db.executescript(SCHEMA)
    db.executemany("INSERT INTO people VALUES (:name, :team, :age)", state["people"])
    db.executemany("INSERT INTO teams VALUES (:name, :room)", state["teams"])
    db.commit()
    return {"db": db}


def dump(live: dict) -> dict:
    """The live database's tables as JSON, rows ordered by name (the inverse of ``load``)."""
    db = live["db"]
    people = db.execute("SELECT name, team, age FROM people ORDER BY name").fetchall()
    teams = db.execute("SELECT name, room FROM teams ORDER BY name").fetchall()
    return {
        "people": [{"name": n, "team": t, "age": a} for n, t, a in people],
        "teams": [{"name": n, "room": r} for n, r in teams],
    }


def query(state: dict, sql: str) -> str:
    """Run one read-only SELECT on people(name, team, age) and teams(name, room); rows as lines, columns joined
    by ', ' ('none' if no rows)."""
    if not SELECT.match(sql):
        raise ToolError(f"only SELECT queries are allowed, got {sql.strip()[:40]!r}")
    try:
        rows = state["db"].execute(sql).fetchall()
    except sqlite3.Error as exc:  # also a second statement after the SELECT: sqlite3 runs one at a time
        raise ToolError(f"bad query: {exc}") from exc
    return "\n".join(", ".join("null" if v is None else str(v) for v in row) for row in rows) or "none"


def update_team(state: dict, person: str, team: str) -> str:
    """Move the person to the team."""
    db = state["db"]
    if db.execute("SELECT 1 FROM teams WHERE name = ?", (team,)).fetchone() is None:
        raise ToolError(f"no team {team!r}")
    if db.execute("UPDATE people SET team = ? WHERE name = ?", (team, person)).rowcount == 0:
        raise ToolError(f"no person {person!r}")
    db.commit()
    return "ok"


OPS = [query, update_team]


def _solved(question: str, state: dict, calls: list[dict], answer: bool = False) -> dict:
    return solved_task(question, state, calls, OPS, answer=str if answer else None, load=load, dump=dump)


def _team_of_sql(person: str) -> str:
    return f"SELECT team FROM people WHERE name = '{person}'"


def _teams(state: dict) -> dict[str, str]:
    """Person -> team."""
    return {row["name"]: row["team"] for row in state["people"]}


def _team_of(state: dict, rng: random.Random) -> dict | None:
    if not (teams := _teams(state)):
        return None
    person = rng.choice(sorted(teams))
    return _solved(f"Team of {person}?", state, [call("query", sql=_team_of_sql(person))], answer=True)


def _room_of(state: dict, rng: random.Random) -> dict | None:
    if not state["teams"]:
        return None
    team = rng.choice(state["teams"])["name"]
    sql = f"SELECT room FROM teams WHERE name = '{team}'"
    return _solved(f"Room of {team}?", state, [call("query", sql=sql)], answer=True)


def _move_to(state: dict, rng: random.Random) -> dict | None:
    teams = _teams(state)
    moves = [(p, t["name"]) for p in sorted(teams) for t in state["teams"] if t["name"] != teams[p]]
    if not moves:
        return None
    person, team = rng.choice(moves)
    return _solved(f"Move {person} to {team}", state, [call("update_team", person=person, team=team)])


def _pairs_apart(state: dict) -> list[tuple[str, str]]:
    """(person, other) pairs in different teams: moving person to other's team is a change."""
    teams = _teams(state)
    return [(p, q) for p in sorted(teams) for q in sorted(teams) if teams[p] != teams[q]]


def _join(state: dict, rng: random.Random, then_count: bool = False) -> dict | None:
    if not (pairs := _pairs_apart(state)):
        return None
    person, other = rng.choice(pairs)
    team = _teams(state)[other]
    calls = [call("query", sql=_team_of_sql(other)), call("update_team", person=person, team=team)]
    if not then_count:
        return _solved(f"Move {person} to {other}'s team", state, calls)
    calls.append(call("query", sql=f"SELECT count(*) FROM people WHERE team = '{team}'"))
    return _solved(f"Move {person} to {other}'s team, how many in it?", state, calls, answer=True)


def _join_then_count(state: dict, rng: random.Random) -> dict | None:
    return _join(state, rng, then_count=True)


def _room_of_team_of(state: dict, rng: random.Random) -> dict | None:
    if not (teams := _teams(state)):
        return None
    person = rng.choice(sorted(teams))
    sql = f"SELECT room FROM teams WHERE name = '{teams[person]}'"
    calls = [call("query", sql=_team_of_sql(person)), call("query", sql=sql)]
    return _solved(f"Room of {person}'s team?", state, calls, answer=True)


MAKERS = {1: [_team_of, _room_of, _move_to], 2: [_join, _room_of_team_of], 3: [_join_then_count]}


server, STATES, TASK = build_task_server(
    "records",
    "people and teams in sqlite: read-only SELECT queries, move people between teams",
    initial_state,
    OPS,
    MAKERS,
    load=load,
    dump=dump,
)


if __name__ == "__main__":
    serve(server)
