"""A sandboxed Python runner as an MCP server: the tool ``run_python(code)`` runs the code in a fresh process per
call, under limits, with no network and no host files but the Python runtime (read-only) and its session's
scratch folder, and returns its exit status, stdout and stderr (each truncated to the output limit, saying so).
A limit that was hit is named in the result ("killed: wall-clock limit 5 s"); it is an ordinary result, not a
tool error. A call that cannot be sandboxed is refused (a tool error saying why): code never runs with less
isolation than described here.

Serving
-------
``python -m rlfabric.envs.code_sandbox_server`` serves one session over stdio; ``--http PORT`` serves streamable
HTTP on 127.0.0.1:PORT, one scratch folder per ``mcp-session-id``. Calls run as child processes awaited on the event
loop, so one long call never holds up other sessions. Flags (defaults in brackets):

    --cpu-s S            CPU seconds per process [2]
    --memory-mib M       address space per process, MiB [256]
    --wall-s S           wall-clock seconds per call [5]
    --output-bytes N     bytes kept of stdout and of stderr each [8192]
    --max-processes N    processes and threads at once per session [16]
    --file-mib M         largest file a call may write, MiB [16]
    --scratch-mib M      size of a session's scratch folder, MiB [64]
    --expose PATH        also show PATH read-only (repeatable), e.g. a site-packages folder holding numpy
    --workdir DIR        where the server keeps its scratch folders [the system temp folder]
    --session-idle-s S   an HTTP session's scratch is dropped after S idle seconds [1800, the SDK's own timeout]

What is enforced, and by what (Linux, run as root)
--------------------------------------------------
The server enters a private mount namespace at start; each session's scratch folder is a tmpfs of
``--scratch-mib`` mounted there, owned by a uid drawn for that session from [2**30, 2**31) (no system account
uses it). It is unmounted and removed when its HTTP session closes (seen through the SDK's per-connection
teardown), when it sits idle past ``--session-idle-s``, and when the server stops; if the server is killed, the
kernel frees it with the server's namespace.

Per call, a launcher process (``code_sandbox_launcher.py``, run as root in a fresh interpreter; it says how)
unshares new mount, PID, network, IPC and UTS namespaces, builds a root on a fresh tmpfs, ``pivot_root``s into it
and detaches the old root, then forks the PID namespace's init, which forks the user's Python process. All by the
kernel:

- network: a new, empty network namespace (loopback only, and down): no socket reaches any host, the server's
  own loopback included; abstract Unix sockets are per namespace too;
- files: the root holds only the Python interpreter's installation (its site-packages hidden behind an empty
  tmpfs unless given to ``--expose``) and the system library folders (``/lib*``, ``/usr/lib*``), bind-mounted
  read-only, nosuid, nodev; ``/dev/{null,zero,full,random,urandom}``; a small ``/dev/shm``; the scratch tmpfs at
  ``/scratch`` (the working directory, ``HOME`` and ``TMPDIR``; ``/tmp`` links to it unless a path under ``/tmp``
  is exposed); the code as ``/main.py``; and the ``--expose`` paths, read-only. Nothing else of the host exists
  there: ``/etc``, ``/home``, ``/proc``, ``/sys`` and the rest are absent, so reading ``/etc/passwd`` fails with
  ``FileNotFoundError``;
- privileges: the code runs as the session's unprivileged uid and gid with no supplementary groups, hence no
  capabilities (it cannot mount, chroot, mknod or signal the server), with ``no_new_privs`` set;
- processes: ``RLIMIT_NPROC`` of ``--max-processes`` binds because the uid is not root (it counts threads too);
  the PID namespace hides every other process. When the main process exits, or at the wall-clock limit, the
  namespace's init kills every process left in it (daemons included: none can leave the namespace) and counts
  them; the result reports that count. The launcher dies with the server and the init with the launcher
  (``PR_SET_PDEATHSIG``), and when the init dies the kernel kills the whole namespace;
- limits: ``RLIMIT_CPU`` (SIGXCPU at the limit, SIGKILL a second later), ``RLIMIT_AS``, ``RLIMIT_FSIZE`` and
  ``RLIMIT_CORE`` = 0 per process; the wall clock is kept by the namespace's init (SIGKILL to all) and, as a
  backstop, by the server (SIGKILL to the launcher's process group).

Not enforced: memory and CPU are limited per process, not per call (a call may hold up to ``--max-processes``
times ``--memory-mib``); concurrent calls of one session share its process limit and scratch; the number of
concurrent calls is not limited; scratch folders are memory (tmpfs), up to ``--scratch-mib`` per session;
user namespaces are not blocked (they grant nothing outside the sandbox's own
view).

How a limit is named: the init observes the wall clock, the main process's end (SIGXCPU or a SIGKILL after its
CPU limit: CPU; SIGXFSZ: file size) and how many processes it had to kill (all slots in use: process limit).
"memory limit" is named when stderr ends in ``MemoryError`` (what ``RLIMIT_AS`` makes Python raise), "process
limit" also when stderr shows a fork failing with EAGAIN: read from the program's words, so a program can fake
or hide them, which misleads only itself.

Fail closed: where any step above fails (not Linux, not root, namespaces or mounts refused, an architecture
without a known ``pivot_root`` number, an ``--expose`` path missing or covering ``/``, ``/dev``, ``/scratch`` or
``/main.py``), the call is refused and the code not run.
"""

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import signal
import site
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from rlfabric.envs import code_sandbox_launcher
from rlfabric.envs.code_sandbox_launcher import (
    CLONE_NEWNS,
    MNT_DETACH,
    MS_PRIVATE,
    MS_REC,
    SYS_PIVOT_ROOT,
    libc_call,
    mount,
    tmpfs,
)

SANDBOX_UIDS = (1 << 30, 1 << 31)
LIBRARY_DIRS = ("/lib", "/lib32", "/lib64", "/usr/lib", "/usr/lib32", "/usr/lib64")
SETUP_GRACE_S = 10.0  # the server's backstop: wall-clock limit plus the launcher's start-up
LAUNCHER = os.path.abspath(code_sandbox_launcher.__file__)  # run as a script under -I -S: standard library only


@dataclass(frozen=True)
class Limits:
    """Per-call limits (see the module docstring for what enforces each)."""

    cpu_s: int = 2  # RLIMIT_CPU counts whole seconds
    memory_mib: int = 256
    wall_s: float = 5.0
    output_bytes: int = 8192
    processes: int = 16
    file_mib: int = 16
    scratch_mib: int = 64


@dataclass
class RunResult:
    """How one call ended. ``exit_code`` is None when the main process died of ``signal``; ``leftover`` counts
    processes still running when it ended (all killed); ``*_total`` are the bytes written, of which the first
    ``output_bytes`` are kept."""

    exit_code: int | None
    signal: int | None
    stdout: bytes
    stdout_total: int
    stderr: bytes
    stderr_total: int
    cpu_s: float
    leftover: int
    wall_hit: bool


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be built here or for this call; the code was not run."""


# ---- result text (pure) ----


def limits_hit(result: RunResult, limits: Limits) -> list[str]:
    """The limits that stopped the program, each as the agent reads it, e.g. ``killed: wall-clock limit 5 s``.

    Wall clock: the init's timer fired. CPU: SIGXCPU, or a SIGKILL we did not send after ``cpu_s`` of CPU. Memory:
    stderr's last line is a ``MemoryError``. Processes: every process slot was in use when the call ended, or a
    fork failed with EAGAIN. File size: SIGXFSZ."""
    hit = []
    tail = result.stderr.rstrip().rsplit(b"\n", 1)[-1]
    if result.wall_hit:
        hit.append(f"killed: wall-clock limit {limits.wall_s:g} s")
    elif result.signal == signal.SIGXCPU or (result.signal == signal.SIGKILL and result.cpu_s >= limits.cpu_s):
        hit.append(f"killed: CPU-time limit {limits.cpu_s} s")
    if result.signal == signal.SIGXFSZ:
        hit.append(f"killed: file-size limit {limits.file_mib} MiB")
    if tail.startswith(b"MemoryError"):
        hit.append(f"stopped: memory limit {limits.memory_mib} MiB (MemoryError)")
    fork_failed = b"BlockingIOError: [Errno 11]" in result.stderr or b"fork: Resource temporarily" in result.stderr
    if result.leftover + 1 >= limits.processes or fork_failed:
        hit.append(f"stopped: process limit {limits.processes}")
    return hit


def shown(data: bytes, total: int, name: str) -> str:
    """``name``'s text block: the kept bytes decoded (bad UTF-8 replaced), and a note when ``total`` bytes were
    written but fewer kept."""
    if total == 0:
        return f"{name}: (empty)"
    text = data.decode("utf-8", errors="replace")
    note = f"\n[{name} truncated: first {len(data)} of {total} bytes shown]" if total > len(data) else ""
    return f"{name}:\n{text}{note}"


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 40`` for a number without a name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def format_result(result: RunResult, limits: Limits) -> str:
    """The tool's reply: limits hit, exit status, processes killed at the end, then stdout and stderr."""
    if result.exit_code is not None:
        status = f"exit status: {result.exit_code}"
    elif result.signal is not None:
        status = f"exit status: killed by {signal_name(result.signal)}"
    else:
        status = "exit status: unknown (the sandbox did not report)"
    lines = [*limits_hit(result, limits), status]
    if result.leftover:
        lines.append(f"processes left running, killed: {result.leftover}")
    lines += [shown(result.stdout, result.stdout_total, "stdout"), shown(result.stderr, result.stderr_total, "stderr")]
    return "\n".join(lines)


# ---- host side: the server ----


def _under(path: str, parents: list[str]) -> bool:
    return any(path == parent or path.startswith(parent.rstrip("/") + "/") for parent in parents)


def _clashes(path: str) -> bool:
    """Whether an exposed ``path`` would cover the sandbox's own root, devices, scratch or code."""
    return path == "/" or _under(path, ["/dev", "/scratch", "/main.py"])


def runtime_view(expose: list[str]) -> dict[str, Any]:
    """What the sandbox's root shows of the host: ``binds`` (read-only folders: the interpreter's installation and
    the library folders, none inside another), ``links`` (library folders that are symlinks, recreated as such),
    ``hide`` (site-packages folders inside the binds, covered by an empty tmpfs) and ``expose`` (shown read-only
    on top); ``python``, the interpreter to run."""
    python = os.path.realpath(sys.executable)
    candidates = [os.path.realpath(sys.base_prefix), os.path.dirname(python)]
    links = {}
    for lib in LIBRARY_DIRS:
        if os.path.islink(lib):
            links[lib] = os.readlink(lib)
        elif os.path.isdir(lib):
            candidates.append(lib)
    binds: list[str] = []
    for path in sorted(set(candidates), key=len):
        if not _under(path, binds):
            binds.append(path)
    shown_paths = [os.path.realpath(path) for path in expose]
    site_dirs = {os.path.realpath(p) for p in site.getsitepackages([sys.base_prefix]) + site.getsitepackages()}
    hide = sorted(p for p in site_dirs if os.path.isdir(p) and _under(p, binds) and p not in shown_paths)
    return {"python": python, "binds": binds, "links": links, "hide": hide, "expose": shown_paths}


@dataclass
class Scratch:
    """A session's scratch folder (a tmpfs) and the uid its code runs as."""

    path: str
    uid: int
    last_used: float
    running: int = 0


async def _drain(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, int]:
    """Read ``stream`` to its end: its first ``limit`` bytes and its total length (the rest is read and dropped, so
    a chatty program never blocks on a full pipe)."""
    kept, total = bytearray(), 0
    while chunk := await stream.read(1 << 16):
        total += len(chunk)
        if len(kept) < limit:
            kept += chunk[: limit - len(kept)]
    return bytes(kept), total


class Sandbox:
    """Runs code in sandboxed child processes (see the module docstring), one scratch folder per session key.

    ``open()`` must run while the process is single-threaded (it enters a private mount namespace); when the sandbox
    cannot be had, ``unavailable`` says why and ``run`` raises ``SandboxUnavailable``."""

    def __init__(
        self,
        limits: Limits,
        workdir: str | None = None,
        expose: list[str] | None = None,
        session_idle_s: float = 1800.0,
    ) -> None:
        self.limits = limits
        self.workdir = workdir
        self.expose = list(expose or [])
        self.session_idle_s = session_idle_s
        self.unavailable: str | None = "not opened"
        self.base: str | None = None
        self.view: dict[str, Any] = {}
        self.sessions: dict[str | None, Scratch] = {}
        self._count = 0

    def open(self) -> None:
        """Check the host, enter a private mount namespace, create the server's folder."""
        machine = platform.machine()
        if sys.platform != "linux":
            self.unavailable = f"needs Linux namespaces; this is {sys.platform}"
        elif os.geteuid() != 0:
            self.unavailable = "needs root (namespaces, mounts and a dedicated uid per session)"
        elif machine not in SYS_PIVOT_ROOT:
            self.unavailable = f"no known pivot_root system call number for {machine}"
        elif missing := [path for path in self.expose if not os.path.exists(path)]:
            self.unavailable = f"--expose paths do not exist: {', '.join(missing)}"
        elif clashing := [path for path in self.expose if _clashes(os.path.realpath(path))]:
            self.unavailable = f"--expose paths clash with the sandbox's own /, /dev, /scratch or /main.py: {clashing}"
        else:
            try:
                libc_call("unshare", CLONE_NEWNS)
                mount(None, "/", None, MS_REC | MS_PRIVATE)  # our scratch mounts never reach the host
                if self.workdir is not None:
                    os.makedirs(self.workdir, exist_ok=True)
                self.base = tempfile.mkdtemp(prefix="rlfabric-sandbox-", dir=self.workdir)
                os.mkdir(os.path.join(self.base, "root"))
                self.view = runtime_view(self.expose)
                self.unavailable = None
            except OSError as exc:
                self.unavailable = str(exc)

    def scratch(self, key: str | None) -> Scratch:
        """Session ``key``'s scratch folder, made on first use; sessions idle past ``session_idle_s`` go first."""
        now = time.monotonic()
        for other, scratch in list(self.sessions.items()):
            if other is not None and scratch.running == 0 and now - scratch.last_used > self.session_idle_s:
                self.end_session(other)
        if key not in self.sessions:
            assert self.base is not None
            self._count += 1
            path = os.path.join(self.base, f"session-{self._count}")
            uid = SANDBOX_UIDS[0] + secrets.randbelow(SANDBOX_UIDS[1] - SANDBOX_UIDS[0])
            options = f"size={self.limits.scratch_mib}m,nr_inodes=16384,mode=0700,uid={uid},gid={uid}"
            tmpfs(path, options)
            self.sessions[key] = Scratch(path, uid, now)
        return self.sessions[key]

    def end_session(self, key: str | None) -> None:
        """Unmount and remove session ``key``'s scratch folder (a call still running there keeps its own view)."""
        scratch = self.sessions.pop(key, None)
        if scratch is not None:
            try:
                libc_call("umount2", scratch.path, MNT_DETACH)
                os.rmdir(scratch.path)
            except OSError as exc:
                print(f"code sandbox: could not remove {scratch.path}: {exc}", file=sys.stderr)

    def close(self) -> None:
        """End every session and remove the server's folder."""
        for key in list(self.sessions):
            self.end_session(key)
        if self.base is not None:
            os.rmdir(os.path.join(self.base, "root"))
            os.rmdir(self.base)
            self.base = None
        self.unavailable = "closed"

    async def run(self, code: str, key: str | None = None) -> RunResult:
        """Run ``code`` in a fresh sandbox on session ``key``'s scratch folder; how it ended."""
        if self.unavailable is not None:
            raise SandboxUnavailable(f"code sandbox unavailable: {self.unavailable}; the code was not run")
        try:
            scratch = self.scratch(key)
        except OSError as exc:
            raise SandboxUnavailable(f"no scratch folder for this session: {exc}; the code was not run") from exc
        scratch.running += 1
        try:
            return await self._launch(code, scratch)
        finally:
            scratch.running -= 1
            scratch.last_used = time.monotonic()

    async def _launch(self, code: str, scratch: Scratch) -> RunResult:
        assert self.base is not None
        status_read, status_write = os.pipe()
        config = {
            **self.view,
            "code": code,
            "root": os.path.join(self.base, "root"),
            "scratch": scratch.path,
            "uid": scratch.uid,
            "limits": vars(self.limits),
            "parent": os.getpid(),
            "status_fd": status_write,
        }
        try:
            process = await asyncio.create_subprocess_exec(
                *[sys.executable, "-I", "-S", LAUNCHER],
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(status_write,),
                start_new_session=True,  # its process group is the backstop's target
            )
        except BaseException:
            os.close(status_read)
            raise
        finally:
            os.close(status_write)
        assert process.stdin is not None and process.stdout is not None and process.stderr is not None
        out = asyncio.ensure_future(_drain(process.stdout, self.limits.output_bytes))
        err = asyncio.ensure_future(_drain(process.stderr, self.limits.output_bytes))
        backstop = False
        try:
            try:
                process.stdin.write(json.dumps(config).encode())
                await process.stdin.drain()
                process.stdin.close()
            except ConnectionError:
                pass  # the launcher died early: its report (none) says so below
            try:
                await asyncio.wait_for(process.wait(), self.limits.wall_s + SETUP_GRACE_S)
            except (asyncio.TimeoutError, TimeoutError):
                backstop = True  # the sandbox's init did not stop it in time
                _kill_group(process.pid)
                await process.wait()
            (stdout, stdout_total), (stderr, stderr_total) = await asyncio.gather(out, err)
        except BaseException:  # this call was cancelled (or failed): nothing of it may keep running
            if process.returncode is None:
                _kill_group(process.pid)  # the launcher's exit takes its namespace down; the loop reaps it
            out.cancel()
            err.cancel()
            os.close(status_read)
            raise
        report = _read_status(status_read)
        if "setup_error" in report:
            raise SandboxUnavailable(f"sandbox setup failed: {report['setup_error']}; the code was not run")
        if not report and not backstop:
            tail = " | ".join(stderr.decode(errors="replace").strip().splitlines()[-3:])
            raise SandboxUnavailable(f"the sandbox launcher failed (exit {process.returncode}): {tail}")
        status = report.get("status")
        return RunResult(
            exit_code=os.waitstatus_to_exitcode(status) if status is not None and os.WIFEXITED(status) else None,
            signal=os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None,
            stdout=stdout,
            stdout_total=stdout_total,
            stderr=stderr,
            stderr_total=stderr_total,
            cpu_s=report.get("cpu_s", 0.0),
            leftover=report.get("leftover", 0),
            wall_hit=backstop or report.get("wall_hit", False),
        )


def _kill_group(pgid: int) -> None:
    """SIGKILL process group ``pgid`` (the launcher's), if any of it is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _read_status(fd: int) -> dict[str, Any]:
    """The launcher's report (written before it exited), or {} when it wrote none."""
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 1 << 16)
    except BlockingIOError:
        data = b""
    finally:
        os.close(fd)
    return json.loads(data) if data else {}


# ---- the MCP server ----


def build_server(sandbox: Sandbox) -> Any:
    """An ``MCPServer`` with the one tool ``run_python``, running calls on ``sandbox``."""
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    limits = sandbox.limits
    server = MCPServer("code-sandbox")
    description = (
        "Run Python 3 code in a fresh sandboxed process and return its exit status, stdout and stderr. No network; "
        "files only in the working directory, which is kept for this session. Limits per call: "
        f"{limits.cpu_s} s CPU, {limits.memory_mib} MiB memory, {limits.wall_s:g} s wall clock, "
        f"{limits.output_bytes} bytes of stdout and of stderr shown; a limit hit is named in the result."
    )

    @server.tool(description=description)
    async def run_python(code: str, ctx: Context) -> str:
        key = (ctx.headers or {}).get("mcp-session-id")
        _end_with_connection(ctx, key, sandbox)
        try:
            result = await sandbox.run(code, key)
        except SandboxUnavailable as exc:
            raise ToolError(str(exc)) from None
        return format_result(result, limits)

    return server


def _end_with_connection(ctx: Any, key: str | None, sandbox: Sandbox) -> None:
    """Drop an HTTP session's scratch when its connection closes. The SDK offers per-connection teardown
    (``Connection.exit_stack``) but no public way to it from a tool's context, hence the guarded private read;
    without it, the idle timeout and the server's stop still remove the scratch."""
    connection = getattr(getattr(ctx.request_context, "session", None), "_connection", None)
    if key is None or connection is None or not hasattr(connection, "exit_stack"):
        return
    if not connection.state.get("code_sandbox_cleanup"):
        connection.state["code_sandbox_cleanup"] = True
        connection.exit_stack.callback(sandbox.end_session, key)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The server's command line (see the module docstring)."""
    defaults = Limits()
    parser = argparse.ArgumentParser(description="Sandboxed Python execution as an MCP server (stdio, or HTTP).")
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT")
    parser.add_argument("--cpu-s", type=int, default=defaults.cpu_s, help="CPU seconds per process")
    parser.add_argument("--memory-mib", type=int, default=defaults.memory_mib, help="address space per process")
    parser.add_argument("--wall-s", type=float, default=defaults.wall_s, help="wall-clock seconds per call")
    parser.add_argument("--output-bytes", type=int, default=defaults.output_bytes, help="kept of stdout, stderr")
    parser.add_argument("--max-processes", type=int, default=defaults.processes, help="per session, threads too")
    parser.add_argument("--file-mib", type=int, default=defaults.file_mib, help="largest file written")
    parser.add_argument("--scratch-mib", type=int, default=defaults.scratch_mib, help="scratch folder size")
    parser.add_argument("--expose", action="append", default=[], metavar="PATH", help="show PATH read-only")
    parser.add_argument("--workdir", help="where scratch folders live (default: the system temp folder)")
    parser.add_argument("--session-idle-s", type=float, default=1800.0, help="drop idle HTTP sessions' scratch")
    args = parser.parse_args(argv)
    for name in ("cpu_s", "memory_mib", "wall_s", "output_bytes", "max_processes", "file_mib", "scratch_mib"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    limits = Limits(
        args.cpu_s, args.memory_mib, args.wall_s, args.output_bytes, args.max_processes, args.file_mib, args.scratch_mib
    )
    sandbox = Sandbox(limits, args.workdir, args.expose, args.session_idle_s)
    sandbox.open()  # first: it needs this process single-threaded
    if sandbox.unavailable:
        print(f"code sandbox unavailable: {sandbox.unavailable}; run_python refuses every call", file=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a terminated server still removes its scratch
    try:
        server = build_server(sandbox)
        if args.http is None:
            server.run()
        else:
            server.run("streamable-http", host="127.0.0.1", port=args.http, session_idle_timeout=args.session_idle_s)
    finally:
        sandbox.close()


if __name__ == "__main__":
    main()
