"""The lock of a live run directory: `RUN_DIR/run.lock`, held by `sparkrl up` (and `--ray`) for the run's
whole life, names the process (pid, host, since when). A second `up` on the directory, with `--resume`,
`--overwrite` or neither, is refused while it is held, so a live run is never joined twice nor deleted;
`sparkrl dead` and `sparkrl report` read it to tell a live run from one that is over.

Taking it is atomic: an exclusive `flock` on the file, which the kernel drops when the last process holding
it is gone: `sparkrl up` and every service it spawned (they inherit the descriptor), so a killed `sparkrl
up` whose learner still runs keeps the run held until that learner has stopped. Its content says who
holds it; a lock whose process is gone (on this host: a killed `sparkrl up`) is stale and taken over, with
a line saying so, once its services have stopped. One held from another host cannot be checked from here:
it counts as live, and the refusal says how to clear it.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from sparkrl.proto.run_files import RunLock

LOCK_FILE = "run.lock"


class RunDirLive(RuntimeError):
    """The run directory is held by a live run; the message says by whom and since when."""

    lock: RunLock | None  # None: held, but its holder has not written its name yet

    def __init__(self, message: str, lock: RunLock | None) -> None:
        super().__init__(message)
        self.lock = lock


def _process_started(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), or None where /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count fields after its last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def read_lock(run_dir: Path) -> RunLock | None:
    """The lock's content; None when there is none (or it cannot be read as one)."""
    try:
        return RunLock.model_validate_json((run_dir / LOCK_FILE).read_bytes())
    except (OSError, ValidationError, ValueError):
        return None


def holder_alive(lock: RunLock) -> bool | None:
    """Whether the lock's process still runs; None when it is on another host (cannot tell from here)."""
    if lock.host != socket.gethostname():
        return None
    try:
        with contextlib.suppress(PermissionError):  # another user's process: it exists
            os.kill(lock.pid, 0)
    except ProcessLookupError:
        return False
    started = _process_started(lock.pid)
    return lock.pid_started is None or started is None or started == lock.pid_started


def live_holder(run_dir: Path) -> RunLock | None:
    """The live run holding `run_dir` (one on another host counts as live), or None."""
    lock = read_lock(run_dir)
    return lock if lock is not None and holder_alive(lock) is not False else None


def describe(lock: RunLock) -> str:
    """`sparkrl up (pid 4242 on host h) since 2025-06-01 12:00:03, 5 min ago`."""
    since = datetime.datetime.fromtimestamp(lock.since).isoformat(sep=" ", timespec="seconds")
    minutes = max(0.0, time.time() - lock.since) / 60
    ago = f"{minutes:.0f} min ago" if minutes >= 1 else "less than a minute ago"
    return f"{lock.command} (pid {lock.pid} on host {lock.host}) since {since}, {ago}"


def refusal(run_dir: Path, lock: RunLock | None, resume: bool, overwrite: bool) -> str:
    """Why a second `sparkrl up` may not use `run_dir`, and what to do instead."""
    who = describe(lock) if lock is not None else "another `sparkrl up` that is starting"
    said = f"{run_dir} is live: {who} runs it"
    if resume:
        said += "; --resume joins a run only once it has stopped (a live one is never joined twice)"
    elif overwrite:
        said += "; --overwrite never deletes a live run"
    fix = f"stop it first (`sparkrl stop --run-dir {run_dir}`, or Ctrl-C where it runs)"
    fix += ", or give another --run-dir"
    if lock is not None and holder_alive(lock) is None:
        fix += f"; if that run is over (it ran on host {lock.host}), delete {run_dir / LOCK_FILE}"
    return f"{said}: {fix}"


class RunDirLock:
    """The held lock of one run directory; `release()` (or leaving the `with`) frees it."""

    run_dir: Path
    took_over: RunLock | None  # the stale lock this one replaced, if any
    _fd: int | None
    _created_dir: bool  # the directory was made for the lock: removed again if the run left it empty

    def __init__(self, run_dir: Path, fd: int, took_over: RunLock | None, created_dir: bool) -> None:
        self.run_dir, self._fd, self.took_over, self._created_dir = run_dir, fd, took_over, created_dir

    @property
    def fd(self) -> int | None:
        """The locked descriptor: `sparkrl up` hands it to every service it spawns, so the lock is held
        until the last of them is gone, even when `sparkrl up` itself is killed."""
        return self._fd

    def release(self) -> None:
        if self._fd is None:
            return
        # Unlinked while still locked: whoever opens the path next finds a new file, never this one.
        with contextlib.suppress(FileNotFoundError):
            (self.run_dir / LOCK_FILE).unlink()
        os.close(self._fd)
        self._fd = None
        if self._created_dir:
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()  # only when empty: a start refused before it wrote anything

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _flock(path: Path) -> int | None:
    """An open descriptor of `path`'s current file under our exclusive flock; None when another holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        # The holder before us may have unlinked the file between our open and our flock: lock the path's
        # current file, not that one.
        if os.path.exists(path) and os.fstat(fd).st_ino == os.stat(path).st_ino:
            return fd
        os.close(fd)


def holders(path: Path) -> dict[int, str]:
    """The processes of this host with `path` open, pid → command name: the services of a killed holder,
    which inherited the lock and keep it until the last of them exits."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if any(os.readlink(fd).removesuffix(" (deleted)") == str(path) for fd in (proc / "fd").iterdir()):
                found[int(proc.name)] = (proc / "comm").read_text().strip()
        except OSError:
            continue
    return found


def _holders(path: Path) -> list[str]:
    return [f"pid {pid} ({name})" for pid, name in holders(path).items()]


def _wait_for_orphans(path: Path, earlier: RunLock, wait_s: float, say: Callable[[str], None]) -> int | None:
    """The lock, once the services a killed `sparkrl up` left behind have exited (they hold it until then:
    an orphan learner must not write into the run while another one starts); None after `wait_s`."""
    said = False
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        fd = _flock(path)
        if fd is not None:
            return fd
        if not said:
            holders = ", ".join(_holders(path)) or "processes of another namespace"
            say(f"{path.parent}: {describe(earlier)} is gone, but its services still hold the run "
                f"({holders}); waiting up to {wait_s:.0f} s for them to stop")  # fmt: skip
            said = True
        time.sleep(0.2)
    return None


def lock_run_dir(
    run_dir: Path,
    command: str,
    resume: bool = False,
    overwrite: bool = False,
    say: Callable[[str], None] = print,
    orphans_wait_s: float = 60.0,
) -> RunDirLock:
    """Take `run_dir` for this process (creating the directory), or raise RunDirLive saying who holds it.

    `resume`/`overwrite` only shape the refusal's words; `say` gets the line about a stale lock taken over.
    A lock whose holder died but whose services still run (they inherit it) is waited for, up to
    `orphans_wait_s`: they stop once their parent is gone.
    """
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir.chmod(0o700)  # the run's logs, samples, secrets and Redis data are its user's alone
    fd = _flock(run_dir / LOCK_FILE)
    earlier = read_lock(run_dir)
    if fd is None and earlier is not None and holder_alive(earlier) is False:
        fd = _wait_for_orphans(run_dir / LOCK_FILE, earlier, orphans_wait_s, say)
        if fd is None:
            holders = ", ".join(_holders(run_dir / LOCK_FILE)) or "processes this host cannot see"
            raise RunDirLive(
                f"{run_dir} is still held by the services of {describe(earlier)}, which is gone: {holders} "
                f"did not stop within {orphans_wait_s:.0f} s; stop them (`kill PID`) and start again",
                earlier,
            )
    if fd is None or (earlier is not None and holder_alive(earlier) is not False):
        # Held, or its holder still runs without the flock (another host sharing this directory).
        if fd is not None:
            os.close(fd)
        raise RunDirLive(refusal(run_dir, earlier, resume, overwrite), earlier)
    if earlier is not None:
        say(f"{run_dir}: taking over a stale lock ({describe(earlier)}; that process is gone)")
    mine = RunLock(
        pid=os.getpid(),
        host=socket.gethostname(),
        pid_started=_process_started(os.getpid()),
        since=time.time(),
        command=command,
    )
    os.ftruncate(fd, 0)
    os.pwrite(fd, mine.model_dump_json().encode(), 0)
    os.fsync(fd)
    return RunDirLock(run_dir, fd, earlier, created)
