"""A small file tree as a stateful MCP task server: a dict of path -> content per session, never on disk.

Paths are relative, '/'-separated ("docs/todo"); a directory exists while a file lies under it; "" (or "." or
"/") is the root. Tools: ``list_dir(path)``, ``read_file(path)``, ``write_file(path, content)`` (creates or
replaces a file), ``move(src, dst)`` (a file or a whole directory; refuses to overwrite) and ``delete(path)`` (a
file). Serve it with ``python -m rlfabric.envs.files_server`` (stdio) or ``--http PORT``.

Tasks, by number of calls: 1 "Read docs/todo" (one lookup); 2 "Copy docs/todo to tmp/plan" (read_file, write_file)
or "Read the file in docs" (list_dir, read_file); 3 "Copy the file in docs to tmp" (list_dir, read_file,
write_file).
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

DIRS = ["docs", "src", "tmp", "home", "mail", "logs"]
NAMES = ["todo", "plan", "note", "list", "log", "main", "test", "draft"]
WORDS = ["milk", "eggs", "run", "fix", "ship", "hi", "done", "wait", "go", "stop", "bug", "cake"]


def initial_state(seed: int) -> dict:
    """3 directories from ``DIRS``, the first with one file and the others with 1-3, file names from ``NAMES``
    (all distinct) and contents of 1-3 words from ``WORDS``, drawn by ``random.Random(seed)``."""
    rng = random.Random(seed)
    folders = rng.sample(DIRS, 3)
    counts = [1, rng.randint(1, 3), rng.randint(1, 3)]
    names = iter(rng.sample(NAMES, sum(counts)))
    files = {}
    for folder, count in zip(folders, counts, strict=True):
        for _ in range(count):
            files[f"{folder}/{next(names)}"] = " ".join(rng.choices(WORDS, k=rng.randint(1, 3)))
    return {"files": files}


def _path(path: str) -> str:
    """``path`` normalized: no leading, trailing or doubled '/', no '.' parts; '..' is refused."""
    parts = [part for part in path.strip().split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ToolError(f"'..' is not allowed in a path, got {path!r}")
    return "/".join(parts)


def _is_dir(state: dict, path: str) -> bool:
    return path == "" or any(f.startswith(path + "/") for f in state["files"])


def list_dir(state: dict, path: str) -> str:
    """The names directly in the directory (subdirectories end in '/'), sorted, comma-separated; '' is the root."""
    folder = _path(path)
    if not _is_dir(state, folder):
        raise ToolError(f"no directory {path!r}")
    prefix = folder + "/" if folder else ""
    names = set()
    for f in state["files"]:
        if f.startswith(prefix):
            head, _, rest = f[len(prefix) :].partition("/")
            names.add(head + "/" if rest else head)
    return ",".join(sorted(names))


def read_file(state: dict, path: str) -> str:
    """The content of the file."""
    file = _path(path)
    if file not in state["files"]:
        raise ToolError(f"{path!r} is a directory" if _is_dir(state, file) else f"no file {path!r}")
    return state["files"][file]


def write_file(state: dict, path: str, content: str) -> str:
    """Write content to the file, creating it (and its directories) or replacing it."""
    file = _path(path)
    if not file or _is_dir(state, file):
        raise ToolError(f"{path!r} is a directory")
    if any(file.startswith(f + "/") for f in state["files"]):
        raise ToolError(f"a file lies on the way to {path!r}")
    state["files"][file] = content
    return "ok"


def move(state: dict, src: str, dst: str) -> str:
    """Move a file or a directory to dst; refuses to replace anything there."""
    source, target = _path(src), _path(dst)
    if not source or not (source in state["files"] or _is_dir(state, source)):
        raise ToolError(f"no file or directory {src!r}")
    if not target or target in state["files"] or _is_dir(state, target):
        raise ToolError(f"{dst!r} already exists")
    if target.startswith(source + "/") or any(target.startswith(f + "/") for f in state["files"]):
        raise ToolError(f"cannot move {src!r} to {dst!r}")
    if source in state["files"]:
        state["files"][target] = state["files"].pop(source)
    else:
        for f in [f for f in state["files"] if f.startswith(source + "/")]:
            state["files"][target + f[len(source) :]] = state["files"].pop(f)
    return "ok"


def delete(state: dict, path: str) -> str:
    """Delete the file."""
    file = _path(path)
    if file not in state["files"]:
        raise ToolError(f"{path!r} is a directory" if _is_dir(state, file) else f"no file {path!r}")
    del state["files"][file]
    return "ok"


OPS = [list_dir, read_file, write_file, move, delete]


def _folders(state: dict) -> dict[str, list[str]]:
    """Directory -> the names of the files directly in it."""
    found: dict[str, list[str]] = {}
    for f in sorted(state["files"]):
        folder, _, name = f.rpartition("/")
        if folder:
            found.setdefault(folder, []).append(name)
    return found


def _read(state: dict, rng: random.Random) -> dict | None:
    if not state["files"]:
        return None
    path = rng.choice(sorted(state["files"]))
    return solved_task(f"Read {path}", state, [call("read_file", path=path)], OPS, answer=str)


def _copy(state: dict, rng: random.Random) -> dict | None:
    folders = _folders(state)
    copies = [
        (f"{a}/{name}", f"{b}/{new}")
        for a in folders
        for name in folders[a]
        for b in folders
        for new in NAMES
        if b != a and new not in folders[b]
    ]
    if not copies:
        return None
    src, dst = rng.choice(copies)
    calls = [call("read_file", path=src), call("write_file", path=dst, content=state["files"][src])]
    return solved_task(f"Copy {src} to {dst}", state, calls, OPS)


def _lone_files(state: dict) -> dict[str, str]:
    """Directories holding exactly one file (and nothing else) -> its name: "the file in docs" names one file."""
    return {folder: names[0] for folder, names in _folders(state).items() if list_dir(state, folder) == names[0]}


def _read_lone(state: dict, rng: random.Random) -> dict | None:
    if not (lone := _lone_files(state)):
        return None
    folder = rng.choice(sorted(lone))
    calls = [call("list_dir", path=folder), call("read_file", path=f"{folder}/{lone[folder]}")]
    return solved_task(f"Read the file in {folder}", state, calls, OPS, answer=str)


def _copy_lone(state: dict, rng: random.Random) -> dict | None:
    lone, folders = _lone_files(state), _folders(state)
    copies = [(a, b) for a in sorted(lone) for b in sorted(folders) if b != a and lone[a] not in folders[b]]
    if not copies:
        return None
    src, dst = rng.choice(copies)
    path = f"{src}/{lone[src]}"
    calls = [
        call("list_dir", path=src),
        call("read_file", path=path),
        call("write_file", path=f"{dst}/{lone[src]}", content=state["files"][path]),
    ]
    return solved_task(f"Copy the file in {src} to {dst}", state, calls, OPS)


MAKERS = {1: [_read], 2: [_copy, _read_lone], 3: [_copy_lone]}


server, STATES, TASK = build_task_server(
    "files", "a small file tree in memory: list, read, write, copy and move files", initial_state, OPS, MAKERS
)


if __name__ == "__main__":
    serve(server)
