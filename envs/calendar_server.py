"""A calendar as a stateful MCP task server: events (id, title, day, hour) per session, one event per slot.

Tools: ``list_day(day)``, ``find_event(title)``, ``create_event(title, day, hour)`` (refuses a clash and a title
already used), ``move_event(event_id, day, hour)`` (refuses a clash) and ``delete_event(event_id)``. Days are 1-7,
hours 0-23. Serve it with ``python -m rlfabric.envs.calendar_server`` (stdio) or ``--http PORT``.

Tasks, by number of calls: 1 "Day of gym?" (find_event; the answer is the day) or "Add yoga on day 3 at 12";
2 "Move gym to day 4 at 10" or "Delete gym" (find_event, then move or delete by its id); 3 "Move gym to call's
day at 15" (find_event twice, move_event).
"""

from __future__ import annotations

import random

from mcp.server.mcpserver.exceptions import ToolError

from rlfabric.envs.task_server import (
    build_task_server,
    call,
    serve,
    solved_task,
)

TITLES = ["gym", "lunch", "call", "demo", "class", "yoga", "chat", "sync", "run", "math", "tea", "walk"]
DAYS = range(1, 8)
TASK_HOURS = range(8, 19)  # where generated events and tasks put things (tools accept any hour 0-23)


def initial_state(seed: int) -> dict:
    """4-6 events with distinct titles from ``TITLES`` in distinct slots (day 1-7, hour 8-18), ids e1, e2, .., drawn
    by ``random.Random(seed)``. Ids carry a letter so that no id reads like a day or an hour."""
    rng = random.Random(seed)
    titles = rng.sample(TITLES, rng.randint(4, 6))
    slots = rng.sample([(day, hour) for day in DAYS for hour in TASK_HOURS], len(titles))
    events = {
        f"e{i}": {"title": t, "day": d, "hour": h} for i, (t, (d, h)) in enumerate(zip(titles, slots, strict=True), 1)
    }
    return {"events": events, "next_event": len(events) + 1}


def _check_slot(state: dict, day: int, hour: int, moving: str | None = None) -> None:
    if day not in DAYS:
        raise ToolError(f"day must be 1-7, got {day}")
    if not 0 <= hour <= 23:
        raise ToolError(f"hour must be 0-23, got {hour}")
    for event_id, event in state["events"].items():
        if (event["day"], event["hour"]) == (day, hour) and event_id != moving:
            raise ToolError(f"day {day} at {hour} already has {event['title']}")


def _event(state: dict, event_id: str) -> dict:
    if event_id not in state["events"]:
        raise ToolError(f"no event {event_id!r}")
    return state["events"][event_id]


def list_day(state: dict, day: int) -> str:
    """The day's events as 'id title hour', by hour, separated by ', ' ('none' if none)."""
    found = sorted((e["hour"], i, e["title"]) for i, e in state["events"].items() if e["day"] == day)
    return ", ".join(f"{i} {title} {hour}" for hour, i, title in found) or "none"


def find_event(state: dict, title: str) -> str:
    """The event with this title, as 'ID day D hour H' (e.g. 'e3 day 2 hour 9')."""
    for event_id, event in state["events"].items():
        if event["title"] == title:
            return f"{event_id} day {event['day']} hour {event['hour']}"
    raise ToolError(f"no event {title!r}")


def create_event(state: dict, title: str, day: int, hour: int) -> str:
    """Add an event at day (1-7) and hour (0-23); refuses a clash. Returns the new event's id."""
    if any(event["title"] == title for event in state["events"].values()):
        raise ToolError(f"an event {title!r} already exists")
    _check_slot(state, day, hour)
    event_id = f"e{state['next_event']}"
    state["events"][event_id] = {"title": title, "day": day, "hour": hour}
    state["next_event"] += 1
    return event_id


def move_event(state: dict, event_id: str, day: int, hour: int) -> str:
    """Move the event to day (1-7) and hour (0-23); refuses a clash."""
    event = _event(state, event_id)
    _check_slot(state, day, hour, moving=event_id)
    event["day"], event["hour"] = day, hour
    return "ok"


def delete_event(state: dict, event_id: str) -> str:
    """Delete the event."""
    _event(state, event_id)
    del state["events"][event_id]
    return "ok"


OPS = [list_day, find_event, create_event, move_event, delete_event]


def _by_title(state: dict) -> dict[str, str]:
    """Title -> event id, for titles that name one event."""
    ids: dict[str, list[str]] = {}
    for event_id, event in state["events"].items():
        ids.setdefault(event["title"], []).append(event_id)
    return {title: found[0] for title, found in sorted(ids.items()) if len(found) == 1}


def _free_slots(state: dict, days: range | list[int] = DAYS) -> list[tuple[int, int]]:
    taken = {(e["day"], e["hour"]) for e in state["events"].values()}
    return [(d, h) for d in days for h in TASK_HOURS if (d, h) not in taken]


def _day_of(state: dict, rng: random.Random) -> dict | None:
    if not (titles := _by_title(state)):
        return None
    title = rng.choice(sorted(titles))
    return solved_task(f"Day of {title}?", state, [call("find_event", title=title)], OPS, answer=_day_in)


def _day_in(found: str) -> str:
    """The day in find_event's result 'ID day D hour H'."""
    return found.split()[2]


def _add(state: dict, rng: random.Random) -> dict | None:
    titles = [t for t in TITLES if all(e["title"] != t for e in state["events"].values())]
    if not titles or not (slots := _free_slots(state)):
        return None
    title, (day, hour) = rng.choice(titles), rng.choice(slots)
    calls = [call("create_event", title=title, day=day, hour=hour)]
    return solved_task(f"Add {title} on day {day} at {hour}", state, calls, OPS)


def _move(state: dict, rng: random.Random) -> dict | None:
    titles = _by_title(state)
    if not titles or not (slots := _free_slots(state)):
        return None
    title, (day, hour) = rng.choice(sorted(titles)), rng.choice(slots)
    calls = [call("find_event", title=title), call("move_event", event_id=titles[title], day=day, hour=hour)]
    return solved_task(f"Move {title} to day {day} at {hour}", state, calls, OPS)


def _delete(state: dict, rng: random.Random) -> dict | None:
    if not (titles := _by_title(state)):
        return None
    title = rng.choice(sorted(titles))
    calls = [call("find_event", title=title), call("delete_event", event_id=titles[title])]
    return solved_task(f"Delete {title}", state, calls, OPS)


def _move_to_day_of(state: dict, rng: random.Random) -> dict | None:
    titles = _by_title(state)
    pairs = [(a, b) for a in titles for b in titles if a != b and _free_slots(state, [_day(state, titles[b])])]
    if not pairs:
        return None
    mover, anchor = rng.choice(pairs)
    day = _day(state, titles[anchor])
    hour = rng.choice([h for _, h in _free_slots(state, [day])])
    calls = [
        call("find_event", title=mover),
        call("find_event", title=anchor),
        call("move_event", event_id=titles[mover], day=day, hour=hour),
    ]
    return solved_task(f"Move {mover} to {anchor}'s day at {hour}", state, calls, OPS)


def _day(state: dict, event_id: str) -> int:
    return state["events"][event_id]["day"]


MAKERS = {1: [_day_of, _add], 2: [_move, _delete], 3: [_move_to_day_of]}


server, STATES, TASK = build_task_server(
    "calendar", "a week's calendar: find, add, move and delete events (no clashes)", initial_state, OPS, MAKERS
)


if __name__ == "__main__":
    serve(server)
