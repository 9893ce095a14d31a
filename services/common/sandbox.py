"""Run code a model wrote (issue 48's Python tool): hostile by assumption, so it runs where it can reach
neither the caller, the host nor another episode.

Each call is its own process tree: a fresh interpreter (no threads, so nothing runs between fork and
exec in the caller) that confines itself, then runs the code:

- **network**: enters a new network namespace (as root, or through a user namespace where the kernel
  allows that): no interface but a down loopback, so every connect fails. Where neither is possible the
  code runs with Python's socket constructors refused, and the result says `network: "refused"`;
- **identity**: as root, drops to a uid and gid of its own for this call (no groups), so it can write
  nothing the host owns and every process it leaves can be found and killed by that uid afterwards;
- **limits** (`SandboxLimits`): CPU seconds, address space, the size of any file it writes, open files,
  processes, no core dumps;
- **files**: starts in a scratch directory of its own (HOME and TMPDIR too), removed after the call;
- **environment**: only PATH, HOME, TMPDIR and LANG; nothing of the caller's (no tokens, no URLs).

The caller waits at most `wall_s`, then kills the process group, and, as root, every process of the
call's uid (a child that left the group with setsid included). Output is read from files, at most
`output_bytes` of each stream kept, stdout's head and stderr's tail (`truncated` says when any was
dropped); a file a call writes, its output included, stops at `file_mb`. The result is a named status,
never an exception: `ok`, `error` (a non-zero exit: the traceback is in `stderr`), `timeout` (the wall
limit), `cpu_limit`, `killed` (another signal).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

SandboxStatus = Literal["ok", "error", "timeout", "cpu_limit", "killed"]
FIRST_UID, UID_SPAN = 200_000, 60_000  # a call's own uid as root: far above any real user's

# Runs as `python -I -c LAUNCHER CONFIG`: confines this process, then runs the code in it (an exec of
# another interpreter would need one the call's uid may run: the venv's may sit under /root).
LAUNCHER = r"""
import ctypes, json, os, resource, sys, traceback
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET, CLONE_NEWUSER, CLONE_NEWNS = 0x40000000, 0x10000000, 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
root = os.geteuid() == 0
def fail(what):
    sys.stderr.write(f"sandbox: {what} failed (errno {ctypes.get_errno()}): the code was not run\n")
    sys.exit(70)
def mount(source, target, kind, flags, data):
    if libc.mount(source.encode(), target.encode(), kind and kind.encode(), flags, data and data.encode()):
        fail(f"mount {target}")
if root:  # own network and mounts: the scratch is /tmp, the other shared writable folders empty tmpfs
    if libc.unshare(CLONE_NEWNET | CLONE_NEWNS):
        fail("unshare")
    mount("none", "/", None, MS_REC | MS_PRIVATE, None)
    mount(cfg["scratch"], "/tmp", None, MS_BIND, None)
    for shared in cfg["shared_dirs"]:
        if os.path.isdir(shared):
            mount("tmpfs", shared, "tmpfs", 0, f"size={cfg['file_mb']}m,mode=1777")
    os.chdir("/tmp")
    os.environ["HOME"] = os.environ["TMPDIR"] = "/tmp"
    net = "namespace"
else:
    net = "namespace" if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0 else "refused"
for name in cfg["preload"]:  # the stdlib may sit where the call's uid cannot read (under /root)
    __import__(name)
def cap(kind, value):
    resource.setrlimit(kind, (value, value))
resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
cap(resource.RLIMIT_AS, cfg["memory_mb"] << 20)
cap(resource.RLIMIT_FSIZE, cfg["file_mb"] << 20)
cap(resource.RLIMIT_NOFILE, cfg["open_files"])
cap(resource.RLIMIT_CORE, 0)
if root:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
cap(resource.RLIMIT_NPROC, cfg["processes"])
prelude = "" if net == "namespace" else cfg["refuse_sockets"]
os.write(cfg["net_fd"], net.encode())
os.close(cfg["net_fd"])
with open("main.py", encoding="utf-8") as f:
    code = compile(prelude + f.read(), "main.py", "exec")
del cfg, libc, cap, mount, fail, f
try:
    exec(code, {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException as exc:  # the traceback from the code's own first frame, not this launcher's
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.exit(1)
"""

SHARED_DIRS = ("/var/tmp", "/run/lock", "/dev/shm")  # writable by anyone: empty in the call's mounts
PRELOAD = (
    "array", "base64", "bisect", "cmath", "collections", "copy", "dataclasses", "datetime", "decimal",
    "enum", "fractions", "functools", "hashlib", "heapq", "io", "itertools", "json", "math", "numbers",
    "operator", "random", "re", "socket", "statistics", "string", "struct", "textwrap", "time", "typing",
    "unicodedata", "encodings.idna", "encodings.latin_1", "encodings.ascii",
)  # fmt: skip  # what the code may import: loaded before the uid drops (others fail to import)
REFUSE_SOCKETS = (
    "import socket as _s\n"
    "def _refused(*a, **k):\n"
    "    raise OSError('network is disabled in the sandbox')\n"
    "_s.socket = _s.create_connection = _s.socketpair = _refused\n"
    "del _s, _refused\n"
)


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    file_mb: int = 8
    open_files: int = 64
    processes: int = 16
    output_bytes: int = 16_384


@dataclass(frozen=True)
class SandboxResult:
    status: SandboxStatus
    exit_code: int | None
    stdout: str
    stderr: str
    truncated: bool
    seconds: float
    network: Literal["namespace", "refused", "unknown"]  # unknown: the launcher died before it said


def run_python(code: str, limits: SandboxLimits | None = None, stdin: str = "") -> SandboxResult:
    """Run `code` under `limits` (module docstring) and say how it ended."""
    limits = limits or SandboxLimits()
    scratch = Path(tempfile.mkdtemp(prefix="sparkrl-sandbox-"))
    uid = _free_uid() if os.geteuid() == 0 else os.geteuid()
    try:
        (scratch / "main.py").write_text(code, encoding="utf-8")
        (scratch / "stdin").write_text(stdin, encoding="utf-8")
        if os.geteuid() == 0:  # the call's own uid owns its folder and files (whatever the umask made them)
            for path in (scratch, scratch / "main.py", scratch / "stdin"):
                os.chown(path, uid, uid)
        scratch.chmod(0o700)
        return _run(scratch, limits, uid)
    finally:
        if os.geteuid() == 0:
            _kill_uid(uid)
        shutil.rmtree(scratch, ignore_errors=True)


def _run(scratch: Path, limits: SandboxLimits, uid: int) -> SandboxResult:
    read_net, write_net = os.pipe()
    config = {
        "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "file_mb": limits.file_mb,
        "open_files": limits.open_files, "processes": limits.processes, "uid": uid, "net_fd": write_net,
        "refuse_sockets": REFUSE_SOCKETS, "scratch": str(scratch), "shared_dirs": SHARED_DIRS,
        "preload": PRELOAD,
    }  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch), "LANG": "C.UTF-8"}
    started = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(scratch / "stdin") as given:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", LAUNCHER, json.dumps(config)],
            stdin=given, stdout=out, stderr=err, cwd=scratch, env=env, start_new_session=True,
            pass_fds=(write_net,), close_fds=True,
        )  # fmt: skip
        os.close(write_net)
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            proc.wait()
        _kill_group(proc.pid)  # whatever it left in its group
        with os.fdopen(read_net, "rb") as pipe:
            said = pipe.read().decode()
        network = said if said in ("namespace", "refused") else "unknown"
        stdout, cut_out = _kept(out, limits.output_bytes, head=True)
        stderr, cut_err = _kept(err, limits.output_bytes, head=False)  # a traceback ends with its point
    code = proc.returncode
    status: SandboxStatus = (
        "timeout" if timed_out
        else "ok" if code == 0
        else "cpu_limit" if code == -signal.SIGXCPU or (code == -signal.SIGKILL and _cpu_spent(started, limits))  # noqa: E501
        else "killed" if code < 0
        else "error"
    )  # fmt: skip
    seconds = time.monotonic() - started
    return SandboxResult(status, code, stdout, stderr, cut_out or cut_err, seconds, network)  # type: ignore[arg-type]


def _cpu_spent(started: float, limits: SandboxLimits) -> bool:
    """A SIGXCPU/SIGKILL death after at least the CPU limit of wall time: the CPU limit's doing."""
    return time.monotonic() - started >= limits.cpu_s * 0.9


def _kept(file: IO[bytes], limit: int, head: bool) -> tuple[str, bool]:
    """At most `limit` bytes of the stream: its head, or its tail; and whether any was dropped."""
    size = file.seek(0, os.SEEK_END)
    file.seek(0 if head else max(size - limit, 0))
    return file.read(limit).decode("utf-8", errors="replace"), size > limit


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
        os.killpg(pgid, signal.SIGKILL)


def _free_uid() -> int:
    """A uid no process holds now, for one call."""
    taken = {_uid_of(pid) for pid in _pids()}
    while True:
        uid = FIRST_UID + random.randrange(UID_SPAN)
        if uid not in taken:
            return uid


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (the call's own), until none is left running (a zombie is dead:
    only its parent, init once the call's launcher is gone, has still to reap it)."""
    for _ in range(50):
        left = [pid for pid in _pids() if _uid_of(pid) == uid and not _zombie(pid)]
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):  # it ended between the listing and the kill
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # gone
    return stat[stat.rindex(")") + 2] in "ZX"


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _uid_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
