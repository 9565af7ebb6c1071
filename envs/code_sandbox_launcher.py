"""The per-call launcher of the code sandbox (``code_sandbox_server.py``): builds one call's sandbox and runs the
code in it. The server starts it as ``python -I -S code_sandbox_launcher.py`` (as root, in the server's private
mount namespace, in a process group of its own), so it uses the standard library only: no site-packages, no
rlfabric. The server's docstring says what the sandbox enforces and by what; this file is how.

Protocol: the call's config arrives on stdin as one JSON object (``code``; ``root``, the empty folder to build the
sandbox's root on; ``scratch`` and ``uid``, the session's; ``limits``, the server's ``Limits`` as a dict;
``python``, ``binds``, ``links``, ``hide`` and ``expose``, the server's ``runtime_view``; ``parent``, the
server's pid; ``status_fd``, an inherited pipe). The code's stdout and stderr are the launcher's own. Before
exiting, the launcher (or the namespace's init) writes one JSON report to ``status_fd``: ``{"setup_error": why}``
when the sandbox could not be built (no code ran), else ``status`` (the main process's wait status), ``cpu_s``,
``leftover`` (processes killed at the end) and ``wall_hit``. No report means the launcher itself failed.

The kernel calls (``libc_call``, ``mount``, ``tmpfs``) are also the server's: it imports them from here.
"""

import contextlib
import ctypes
import json
import os
import platform
import resource
import signal
import sys
import time
from typing import Any

# linux/sched.h, linux/mount.h, linux/prctl.h
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
DEVICES = ("null", "zero", "full", "random", "urandom")


# ---- kernel calls ----

_LIBC: Any = None


def libc_call(name: str, *args: Any) -> int:
    """libc's ``name(*args)`` (str arguments passed as bytes); an ``OSError`` naming the call when it fails."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    # strings as bytes; ints as C longs, wide enough for every flags argument (ctypes would pass a C int)
    raw = [
        os.fsencode(arg) if isinstance(arg, str) else ctypes.c_long(arg) if isinstance(arg, int) else arg
        for arg in args
    ]
    result = getattr(_LIBC, name)(*raw)
    if result == -1:
        errno = ctypes.get_errno()
        shown_args = ", ".join(repr(arg) for arg in args)
        raise OSError(errno, f"{name}({shown_args}) failed: {os.strerror(errno)}")
    return result


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    """mount(2); None passes NULL (a remount or propagation change needs no source, type or data)."""
    libc_call("mount", source, target, fstype, flags, data)


def _bind(source: str, target: str, *, writable: bool = False, devices: bool = False) -> None:
    """Bind ``source`` (a folder or a file) at ``target``: read-only unless ``writable``, nosuid, nodev unless
    ``devices``. Not recursive: mounts below ``source`` stay hidden."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    elif not os.path.exists(target):  # a file's mount point (an exposed file may already show through a bind)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    mount(source, target, None, MS_BIND)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | (0 if writable else MS_RDONLY) | (0 if devices else MS_NODEV)
    mount(None, target, None, flags)


def tmpfs(target: str, options: str, flags: int = MS_NOSUID | MS_NODEV) -> None:
    """A fresh tmpfs at ``target`` (made if missing) with mount ``options``, e.g. ``size=16m,mode=0755``."""
    os.makedirs(target, exist_ok=True)
    mount("tmpfs", target, "tmpfs", flags, options)


# ---- the launcher ----


def _launcher() -> None:
    """Read the call's config from stdin, build the sandbox (any failure is reported as ``setup_error`` before any
    code runs), fork the PID namespace's init and wait for it."""
    config = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    status = os.fdopen(config["status_fd"], "w")
    try:
        libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != config["parent"]:
            raise OSError("the server exited before the sandbox started")
        libc_call("unshare", CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
        _build_root(config)
    except OSError as exc:
        status.write(json.dumps({"setup_error": str(exc)}))
        status.close()
        os._exit(1)
    init = os.fork()  # pid 1 of the new PID namespace
    if init == 0:
        try:
            _init(config, status)
        except BaseException as exc:  # noqa: BLE001 - said on stderr; no report makes the call fail
            os.write(2, f"code sandbox: the sandbox's init failed: {exc!r}\n".encode())
        os._exit(1)
    os.waitpid(init, 0)
    os._exit(0)


def _build_root(config: dict[str, Any]) -> None:
    """Mount the sandbox's root on a tmpfs (what it holds: ``code_sandbox_server``'s docstring) and pivot into it."""
    os.umask(0o022)
    root = config["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    tmpfs(root, "size=16m,mode=0755")
    for path in config["binds"]:
        _bind(path, root + path)
    for path in config["hide"]:
        tmpfs(root + path, "size=4k,mode=0755")  # root's, so the code cannot write there either
    for path in config["expose"]:
        _bind(path, root + path)
    for link, target in config["links"].items():
        os.symlink(target, root + link)
    for device in DEVICES:
        _bind(f"/dev/{device}", f"{root}/dev/{device}", writable=True, devices=True)
    tmpfs(f"{root}/dev/shm", f"size={config['limits']['file_mib']}m,mode=1777")
    _bind(config["scratch"], f"{root}/scratch", writable=True)
    if not os.path.lexists(f"{root}/tmp"):  # an exposed path under /tmp keeps /tmp a folder
        os.symlink("/scratch", f"{root}/tmp")
    with open(f"{root}/main.py", "w", encoding="utf-8", errors="replace") as main:  # lone surrogates: '?'
        main.write(config["code"])
    os.chmod(f"{root}/main.py", 0o444)
    # pivot_root(".", "."): the old root ends up on top of the new one, and is then detached from this namespace
    os.chdir(root)
    libc_call("syscall", SYS_PIVOT_ROOT[platform.machine()], ".", ".")
    libc_call("umount2", ".", MNT_DETACH)
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    libc_call("sethostname", "sandbox", 7)


def _init(config: dict[str, Any], status: Any) -> None:
    """PID 1 of the sandbox: run the code, reap, stop everything at the wall clock or when the main process ends,
    and report how it ended (wait status, CPU seconds, processes killed, wall clock hit)."""
    libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # waited for with sigtimedwait, no handler races
    main = os.fork()
    if main == 0:
        _exec_code(config)
    deadline = time.monotonic() + config["limits"]["wall_s"]
    report: dict[str, Any] = {"status": None, "cpu_s": 0.0, "leftover": 0, "wall_hit": False}

    def reap(block: bool, ending: bool) -> None:
        """Reap every child that has exited (all of them when ``block``); when ``ending``, count the others."""
        while True:
            try:
                pid, wait_status, usage = os.wait4(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == main:
                report["status"], report["cpu_s"] = wait_status, usage.ru_utime + usage.ru_stime
            elif ending:
                report["leftover"] += 1

    while report["status"] is None:
        reap(block=False, ending=False)
        remaining = deadline - time.monotonic()
        if report["status"] is None and remaining <= 0:
            report["wall_hit"] = True
        elif report["status"] is None:
            signal.sigtimedwait({signal.SIGCHLD}, remaining)
            continue
        break
    with contextlib.suppress(ProcessLookupError):  # none left
        os.kill(-1, signal.SIGKILL)  # every other process in this namespace: still running when the call ended
    reap(block=True, ending=True)
    status.write(json.dumps(report))
    status.close()
    os._exit(0)


def _exec_code(config: dict[str, Any]) -> None:
    """The user's process: limits, then the session's uid with no capabilities and no_new_privs, then Python."""
    try:
        limits = config["limits"]
        cpu = limits["cpu_s"]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mib"] << 20,) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_mib"] << 20,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        uid = config["uid"]
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # drops every capability
        libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        os.chdir("/scratch")
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.closerange(3, 1 << 16)
        python = config["python"]
        env = {"PATH": os.path.dirname(python), "HOME": "/scratch", "TMPDIR": "/scratch", "LANG": "C.UTF-8"}
        os.execve(python, [python, "-I", "-u", "/main.py"], env)
    except BaseException as exc:  # noqa: BLE001 - reported on the code's stderr, then this process ends
        os.write(2, f"code sandbox: could not start the code: {exc}\n".encode())
    os._exit(127)


if __name__ == "__main__":
    _launcher()
