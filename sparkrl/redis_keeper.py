"""`sparkrl up`'s private Redis, kept until the run's other services are gone: `python -m
sparkrl.redis_keeper REDIS_SERVER REDIS_CONF` runs `redis-server REDIS_CONF` and stops it only after them.

Every service of `sparkrl up` gets SIGTERM from the kernel when `sparkrl up` itself is killed (its
parent-death signal). Redis stops on SIGTERM at once, so the learner finishing its step would find no Redis
to commit it to: the step is redone after `--resume` (exactly once all the same, but work lost). Its keeper
takes that SIGTERM instead and waits, up to `KEEP_S`, until no other process holds the run's lock
(`RUN_DIR/run.lock`, which every service inherits), then stops Redis: the learner commits and stops first.
In an ordinary shutdown the launcher stops Redis last, when nobody else holds the lock: it stops at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from sparkrl.run_lock import LOCK_FILE, holders

KEEP_S = 30.0  # longest the run's services are waited for; then Redis stops anyway
_PR_SET_PDEATHSIG = 1


def _die_with_keeper() -> None:
    # A keeper killed outright (SIGKILL) must not leave its Redis running on the run's port.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def others_hold(lock: Path, mine: set[int]) -> dict[int, str]:
    """The processes other than `mine` that hold the run's lock (the run's services still stopping)."""
    return {pid: name for pid, name in holders(lock).items() if pid not in mine}


def keep(server: str, conf: Path) -> int:
    """Run Redis until told to stop, then stop it once the run's other services are gone; its exit code."""
    redis = subprocess.Popen([server, str(conf)], preexec_fn=_die_with_keeper)
    told = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: told.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's to act on
    while not told.wait(0.2) and redis.poll() is None:
        continue  # Redis serves; the keeper only waits to be told to stop (or for Redis to die)
    if redis.poll() is None:
        # Not counted: the keeper and its Redis, and the launcher that holds the lock while it stops the run
        # (its parent; once the launcher is killed, the parent is init).
        lock, mine = conf.parent.parent / LOCK_FILE, {os.getpid(), redis.pid, os.getppid()}
        deadline = time.monotonic() + KEEP_S
        while (waiting := others_hold(lock, mine)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if waiting:
            print(
                f"redis keeper: stopping Redis while {sorted(waiting.items())} still hold the run", flush=True
            )
        redis.terminate()
    return redis.wait()


if __name__ == "__main__":
    code = keep(sys.argv[1], Path(sys.argv[2]))
    sys.exit(code if code >= 0 else 128 - code)
