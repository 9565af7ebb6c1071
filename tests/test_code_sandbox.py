"""The sandboxed code-execution MCP server, through the real protocol (stdio; one test over HTTP): code runs and
keeps its session's scratch; no network, no host files, no privileges; a fork bomb, a memory hog, an endless loop,
a sleeper and a flood of output are each stopped and named; nothing outlives a call; a session's call never waits
on another's; a sandbox that cannot be built refuses to run code."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from http_servers import free_port, wait_for_port

from rlfabric.envs.code_sandbox_server import Limits, RunResult, format_result
from rlfabric.mcp_tools import McpSession, McpToolError

SERVER = [sys.executable, "-m", "rlfabric.envs.code_sandbox_server"]


def sandbox(workdir: Path, *flags: str) -> list[str]:
    return [*SERVER, "--workdir", str(workdir), *flags]


async def run(session: McpSession, code: str) -> str:
    return await session.call("run_python", {"code": code})


async def calls(server: list[str] | str, codes: list[str]) -> list[str]:
    """Each code's result, in order, on one session."""
    session = await McpSession.open(server, timeout_s=60.0)
    try:
        return [await run(session, code) for code in codes]
    finally:
        await session.close()


def stdout_of(result: str) -> str:
    return result.split("stdout:\n", 1)[1].split("\nstderr:", 1)[0].strip()


def test_code_runs_its_scratch_lasts_the_session_and_is_removed_with_the_server(tmp_path):
    printed, failed, wrote, read, where = asyncio.run(
        calls(
            sandbox(tmp_path),
            [
                "print('hello', 6 * 7)",
                "import sys; print('to stderr', file=sys.stderr); sys.exit(3)",
                "open('kept.txt', 'w').write('from call 3')",
                "print(open('kept.txt').read())",
                "import os; print(os.getcwd(), sorted(os.listdir('/')))",
            ],
        )
    )
    assert printed == "exit status: 0\nstdout:\nhello 42\n\nstderr: (empty)"
    assert failed.startswith("exit status: 3\nstdout: (empty)\nstderr:\nto stderr")
    assert wrote.startswith("exit status: 0") and stdout_of(read) == "from call 3"
    assert stdout_of(where) == "/scratch ['dev', 'lib', 'lib64', 'main.py', 'root', 'scratch', 'tmp', 'usr']"
    assert list(tmp_path.iterdir()) == []  # the server's folder and the session's scratch are gone


def test_no_network_even_to_a_server_the_test_reaches(tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(2.0)
    port = listener.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port), timeout=5.0):  # works from outside the sandbox
        listener.accept()[0].close()
    listener.settimeout(0.5)  # a connection from the sandbox would be queued by the time its call returned
    code = (
        "import socket\n"
        f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\n"
        "except OSError as exc:\n    print('refused:', exc)\n"
        "print('interfaces:', socket.if_nameindex())"
    )
    (result,) = asyncio.run(calls(sandbox(tmp_path), [code]))
    assert "refused: [Errno 101] Network is unreachable" in result and "connected" not in result
    assert "interfaces: [(1, 'lo')]" in result  # a namespace of its own: loopback only, and down
    with pytest.raises(TimeoutError):
        listener.accept()  # nothing reached the test's server
    listener.close()


def test_no_host_files_but_exposed_ones_read_only_and_no_privileges(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "data.txt").write_text("shared data")
    probes = {
        "secret": f"open({str(secret)!r}).read()",
        "passwd": "open('/etc/passwd').read()",
        "proc": "open('/proc/self/status').read()",
        "shared": f"open({str(shared / 'data.txt')!r}).read()",
        "write_shared": f"open({str(shared / 'planted')!r}, 'w')",
        "write_usr": "open('/usr/lib/planted', 'w')",
        "write_root": "open('/planted', 'w')",
        "chroot": "os.chroot('/scratch')",
        "mount": "ctypes.CDLL(None, use_errno=True).mount(b'none', b'/scratch', b'tmpfs', 0, None) or 'mounted'",
    }
    code = "import ctypes, os\n" + "".join(
        f"try:\n    print({name!r}, 'ok', {probe})\nexcept OSError as exc:\n    print({name!r}, type(exc).__name__)\n"
        for name, probe in probes.items()
    )
    code += "print('mount errno', ctypes.get_errno())\n"
    (result,) = asyncio.run(calls(sandbox(tmp_path / "work", "--expose", str(shared)), [code]))
    assert stdout_of(result).splitlines() == [
        "secret FileNotFoundError",
        "passwd FileNotFoundError",
        "proc FileNotFoundError",
        "shared ok shared data",
        "write_shared OSError",  # read-only mount (EROFS)
        "write_usr OSError",
        "write_root OSError",
        "chroot PermissionError",
        "mount ok -1",
        "mount errno 1",  # EPERM: no capabilities left
    ]
    assert "host secret" not in result and not (shared / "planted").exists()


def test_fork_bomb_memory_hog_endless_loop_and_flood_are_stopped_and_named(tmp_path):
    fork_bomb = "import os\nwhile True:\n    os.fork()"
    memory_hog = "hog = bytearray(1 << 30)"
    endless_loop = "while True:\n    pass"
    flood = "print('x' * 100_000)"
    start = time.monotonic()
    bomb, hog, loop, flooded, after = asyncio.run(
        calls(
            # the wall clock is generous next to the CPU limit: a busy 2-core machine gives a loop a share of a core
            sandbox(tmp_path, "--cpu-s", "1", "--wall-s", "12", "--max-processes", "8", "--output-bytes", "4000"),
            [fork_bomb, memory_hog, endless_loop, flood, "print('still serving')"],
        )
    )
    assert bomb.startswith("stopped: process limit 8\n") and "BlockingIOError: [Errno 11]" in bomb
    assert hog.startswith("stopped: memory limit 256 MiB (MemoryError)\nexit status: 1")
    assert loop.startswith("killed: CPU-time limit 1 s\nexit status: killed by SIGXCPU")
    assert stdout_of(flooded) == "x" * 4000 + "\n[stdout truncated: first 4000 of 100001 bytes shown]"
    assert stdout_of(after) == "still serving"
    assert time.monotonic() - start < 30.0


def sandboxed_processes() -> list[int]:
    """Host pids running as any sandbox uid (drawn from [2**30, 2**31))."""
    pids = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and 1 << 30 <= entry.stat().st_uid < 1 << 31:
                pids.append(int(entry.name))
        except FileNotFoundError:
            pass  # exited while we looked
    return pids


def test_processes_left_running_are_killed_when_the_call_returns_or_is_cancelled(tmp_path):
    daemon = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(1.5)\n"
        "        open('marker', 'w').write('outlived the call')\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"  # the daemon is up and reparented before the main process ends
    )
    look_later = "import os, time\ntime.sleep(2.5)\nprint(os.path.exists('marker'))"

    async def scenario() -> tuple[str, list[int], str, list[int]]:
        # the wall clock is far off: only the cancellation can stop the last call in time
        session = await McpSession.open(sandbox(tmp_path, "--wall-s", "60"), timeout_s=60.0)
        try:
            left = await run(session, daemon)
            running = sandboxed_processes()  # on the host, right after the call returned
            later = await run(session, look_later)
            with pytest.raises(TimeoutError):  # the client gives up; the server cancels the call
                await asyncio.wait_for(run(session, "import time\ntime.sleep(600)"), 2.0)
            deadline = time.monotonic() + 10.0
            while sandboxed_processes() and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            return left, running, later, sandboxed_processes()
        finally:
            await session.close()

    left, running, later, after_cancel = asyncio.run(scenario())
    assert "exit status: 0\nprocesses left running, killed: 1\n" in left
    assert running == [] and after_cancel == []
    assert stdout_of(later) == "False"


def test_over_http_sessions_are_isolated_and_one_never_waits_on_another(tmp_path):
    port = free_port()
    server = subprocess.Popen([*sandbox(tmp_path, "--wall-s", "5"), "--http", str(port)], stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        wait_for_port(port, 60.0)

        async def scenario() -> tuple[str, float, str, float]:
            slow, quick = await McpSession.open(url), await McpSession.open(url)
            start = time.monotonic()
            try:

                async def timed(session: McpSession, code: str) -> tuple[str, float]:
                    result = await run(session, code)
                    return result, time.monotonic() - start

                sleeper = "open('mine', 'w').write('1')\nprint('going to sleep')\nimport time\ntime.sleep(600)"
                slow_call = asyncio.ensure_future(timed(slow, sleeper))
                await asyncio.sleep(1.0)  # the slow call is running
                (seen, quick_s), (stopped, slow_s) = await asyncio.gather(
                    timed(quick, "import os; print(os.listdir('.'))"), slow_call
                )
                return seen, quick_s, stopped, slow_s
            finally:
                await slow.close()
                await quick.close()

        seen, quick_s, stopped, slow_s = asyncio.run(scenario())
        assert stdout_of(seen) == "[]"  # the other session's file is not here
        assert quick_s < slow_s and stopped.startswith("killed: wall-clock limit 5 s\nexit status: killed by SIGKILL")
        assert stdout_of(stopped) == "going to sleep"  # what it printed before the kill is kept
        (folder,) = tmp_path.iterdir()
        deadline = time.monotonic() + 10.0
        while sorted(p.name for p in folder.iterdir()) != ["root"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sorted(p.name for p in folder.iterdir()) == ["root"]  # closed sessions' scratch removed
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    assert list(tmp_path.iterdir()) == []


def test_a_sandbox_that_cannot_be_built_refuses_to_run_code(tmp_path):
    missing = tmp_path / "no-such-folder"
    marker = tmp_path / "ran"
    with pytest.raises(McpToolError) as info:
        asyncio.run(calls(sandbox(tmp_path, "--expose", str(missing)), [f"open({str(marker)!r}, 'w')"]))
    assert "code sandbox unavailable: --expose paths do not exist" in str(info.value)
    assert str(info.value).endswith("the code was not run") and not marker.exists()


def test_result_text_names_limits_from_how_the_program_ended():
    limits = Limits(cpu_s=2, wall_s=5, processes=4)

    def ended(**fields) -> str:
        base = dict(exit_code=None, signal=None, stdout=b"", stdout_total=0, stderr=b"", stderr_total=0)
        return format_result(RunResult(**{**base, "cpu_s": 0.0, "leftover": 0, "wall_hit": False, **fields}), limits)

    assert ended(signal=9, wall_hit=True, leftover=3, stdout=b"abc", stdout_total=10) == (
        "killed: wall-clock limit 5 s\nstopped: process limit 4\nexit status: killed by SIGKILL\n"
        "processes left running, killed: 3\nstdout:\nabc\n[stdout truncated: first 3 of 10 bytes shown]\n"
        "stderr: (empty)"
    )
    assert ended(signal=9, cpu_s=2.2).startswith("killed: CPU-time limit 2 s\nexit status: killed by SIGKILL\n")
    assert ended(signal=9, cpu_s=0.3).startswith("exit status: killed by SIGKILL\n")  # a kill, but not the CPU's
    assert ended(signal=40).startswith("exit status: killed by signal 40\n")
    assert ended(exit_code=1, stderr=b"Traceback ...\nMemoryError\n", stderr_total=24).startswith(
        "stopped: memory limit 256 MiB (MemoryError)\nexit status: 1\n"
    )
    assert ended(exit_code=0, leftover=2).startswith("exit status: 0\nprocesses left running, killed: 2\n")
    assert ended(exit_code=0, stdout=b"\xff ok", stdout_total=4).endswith("stdout:\n\ufffd ok\nstderr: (empty)")
