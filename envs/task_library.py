"""The shipped stateful MCP task servers by name, and tasks sampled from their live state.

``TASK_SERVERS`` holds every server (``rlfabric.envs.task_server.TaskServer``); ``task_server(name)`` finds one.
``sample_tasks(server, n, seed, calls)`` draws ``n`` tasks through ONE MCP session on the server (its command
line, or the URL of a running one): for task k it resets the session to a seed drawn from ``random.Random(seed)``,
reads the live state with ``env_state`` and hands it to the server's ``make_task``. The result depends only on
the arguments: the same arguments give the same tasks.
"""

from __future__ import annotations

import json
import random

from rlfabric.envs import bank_server, calendar_server, files_server, notes_server, records_server, shop_server
from rlfabric.envs.task_server import TaskServer
from rlfabric.mcp_tools import McpSession

TASK_SERVERS: dict[str, TaskServer] = {
    module.TASK.name: module.TASK
    for module in (notes_server, bank_server, shop_server, calendar_server, records_server, files_server)
}


def task_server(name: str) -> TaskServer:
    """The shipped task server called ``name``; a ValueError naming the known ones otherwise."""
    if name not in TASK_SERVERS:
        raise ValueError(f"unknown task server {name!r}; known: {', '.join(sorted(TASK_SERVERS))}")
    return TASK_SERVERS[name]


def calls_range(server: TaskServer, calls: int | tuple[int, int]) -> tuple[int, int]:
    """``calls`` as an inclusive (low, high) range inside the server's ``min_calls..max_calls``; a ValueError
    naming the server's range otherwise."""
    low, high = (calls, calls) if isinstance(calls, int) else calls
    if not server.min_calls <= low <= high <= server.max_calls:
        raise ValueError(
            f"calls for the {server.name} server must lie in {server.min_calls}..{server.max_calls}, got {calls!r}"
        )
    return low, high


async def sample_tasks(
    server: TaskServer, n: int, seed: int, calls: int | tuple[int, int], url: str | None = None
) -> list[dict]:
    """``n`` tasks from the live state of ``server`` (started from its command, or at ``url``), through one
    session. Task k: seed_k = rng.randrange(2**31) and calls_k = rng.randint(*calls) (when ``calls`` is a range)
    with rng = random.Random(seed); the session is reset to seed_k, its state read, and the task is
    ``make_task(state, random.Random(f"{name}:{seed_k}:{calls_k}"), calls_k)`` plus the keys ``server`` (the
    name), ``seed`` (seed_k) and ``calls`` (calls_k): a task is a function of its own keys alone."""
    low, high = calls_range(server, calls)
    rng = random.Random(seed)
    session = await McpSession.open(url or server.command)
    tasks = []
    try:
        for _ in range(n):
            seed_k = rng.randrange(2**31)
            calls_k = rng.randint(low, high) if low < high else low
            await session.call("env_reset", {"seed": seed_k})
            state = json.loads(await session.call("env_state"))
            task = server.make_task(state, random.Random(f"{server.name}:{seed_k}:{calls_k}"), calls_k)
            tasks.append({**task, "server": server.name, "seed": seed_k, "calls": calls_k})
        await session.call("env_close")  # an HTTP server frees this session's state
    finally:
        await session.close()
    return tasks
