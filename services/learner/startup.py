"""The learner's start-up guards: a stale DeepSpeed build lock is named (and cleared), and a start that
hangs anyway ends with a clear error instead of waiting forever.

DeepSpeed JIT-compiles a C++ op on first start; torch guards the build with a `lock` file in the
extension's folder under `TORCH_EXTENSIONS_DIR`. A build killed mid-way (Ctrl-C during the first start)
leaves that file behind, and every later start waits for it to go away — silently, for ever. A lock no
live process is building under is stale: it is removed, with a warning that names it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("sparkrl.learner.startup")


def extensions_dir() -> Path:
    """Where torch builds extensions (what `torch.utils.cpp_extension` uses)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("probe", verbose=False)).parent


def pin_build_tools() -> None:
    """The interpreter's own `bin/` first on PATH, before DeepSpeed builds its op. torch's JIT build runs the
    first `ninja` on PATH, and ninja versions keep incompatible build logs (1.11 writes v5, 1.12+ v7): a
    folder built by one is rebuilt from scratch by the other, 20-40 s. A shell with the venv activated finds
    the venv's ninja, `make demo` (`.venv/bin/sparkrl`, no venv on PATH) the system's: every switch rebuilt.
    With this, every start of one interpreter builds with the same ninja whatever PATH the user has."""
    own = str(Path(sys.executable).parent)
    rest = [entry for entry in os.environ.get("PATH", "").split(os.pathsep) if entry and entry != own]
    os.environ["PATH"] = os.pathsep.join([own, *rest])


def build_locks(root: Path) -> Iterator[Path]:
    if root.is_dir():
        yield from (lock for lock in root.glob("*/lock") if lock.is_file())


def _busy(folder: Path) -> bool:
    """Whether a live process works in `folder`: it holds the build lock open (torch's file baton keeps the
    lock's descriptor until it releases it, through the whole load, a build or only a version check), its
    cwd is there, or an argument names it. A data-parallel learner's other rank loading the op while this
    one starts holds the lock: removing it would fail that rank's release."""
    target = str(folder.resolve())
    lock = str(folder.resolve() / "lock")
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(proc / "cwd")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if cwd.startswith(target) or target in cmdline:
                return True
            if any(os.readlink(fd) == lock for fd in (proc / "fd").iterdir()):
                return True
        except OSError:
            continue
    return False


def clear_stale_locks(root: Path | None = None) -> list[Path]:
    """Remove build locks that no live process holds; returns them (each also logged)."""
    root = root or extensions_dir()
    cleared = []
    for lock in build_locks(root):
        if _busy(lock.parent):
            log.info("an extension build is under way in %s: waiting for it", lock.parent)
            continue
        log.warning("removing a stale build lock %s (left by a build that was killed mid-way)", lock)
        lock.unlink(missing_ok=True)
        cleared.append(lock)
    return cleared


def watchdog(timeout_s: float) -> threading.Timer:
    """Started before the engine is built, cancelled once it is: past `timeout_s`, name what the start is
    waiting on and exit (a build lock wait ignores SIGTERM; a supervisor then sees a clear failure)."""

    def expire() -> None:
        locks = [str(lock) for lock in build_locks(extensions_dir())]
        held = (
            f"; build locks present: {', '.join(locks)} (delete them if no build is running)" if locks else ""
        )
        log.error(
            "the learner did not start within %.0f s (learner.startup_timeout_s): DeepSpeed's first start "
            "compiles an op (set TORCH_EXTENSIONS_DIR to keep it between runs)%s",
            timeout_s,
            held,
        )
        os._exit(3)  # the main thread may be stuck in C++: only this ends the process

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    return timer
