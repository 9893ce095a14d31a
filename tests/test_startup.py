"""The learner's start-up guards, on real processes: a build lock left by a killed DeepSpeed compile is
named and cleared; a start that waits on a lock a live build holds ends, past its timeout, with an error
that names the lock (instead of waiting silently for ever and ignoring SIGTERM)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env, free_port

from sparkrl.services.learner.startup import clear_stale_locks, extensions_dir

pytestmark = pytest.mark.slow


def test_only_locks_no_process_builds_under_are_cleared(tmp_path: Path) -> None:
    stale, busy = tmp_path / "stale_op", tmp_path / "busy_op"
    for folder in (stale, busy):
        folder.mkdir()
        (folder / "lock").touch()
    builder = subprocess.Popen(["sleep", "30"], cwd=busy)  # what a compiler in that folder looks like
    try:
        assert clear_stale_locks(tmp_path) == [stale / "lock"]
        assert not (stale / "lock").exists() and (busy / "lock").exists()
    finally:
        builder.kill()
        builder.wait()


def test_a_lock_a_process_holds_open_is_not_cleared(tmp_path: Path) -> None:
    """torch's file baton keeps the lock's descriptor open while it loads the op (a version check, or a
    build), elsewhere than its folder: a data-parallel learner's other rank. Clearing that lock made the
    rank's release fail (FileNotFoundError) and the learner with it."""
    folder = tmp_path / "op"
    folder.mkdir()
    lock = folder / "lock"
    # The path comes in the environment: neither the command line nor the cwd names the folder.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import os, time; fd = os.open(os.environ['LOCK'], os.O_CREAT | os.O_EXCL); "
         "print('held', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE, text=True, cwd=tmp_path, env={**os.environ, "LOCK": str(lock)},
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert clear_stale_locks(tmp_path) == [] and lock.exists()
    finally:
        holder.kill()
        holder.wait()
    assert clear_stale_locks(tmp_path) == [lock] and not lock.exists()  # its holder gone: stale


@pytest.fixture
def shm_lock(tmp_path: Path) -> Iterator[Path]:
    """The lock of the op DeepSpeed builds on a CPU learner's first start, as a killed build leaves it — in
    a copy of the extensions folder (the op already built there, when it is), never in the one every other
    learner uses: a learner starting beside this test (the slow tier runs two at a time) would wait on it."""
    private = tmp_path / "torch_extensions"
    if extensions_dir().is_dir():
        shutil.copytree(extensions_dir(), private, ignore=shutil.ignore_patterns("lock"))
    folder = private / "deepspeed_shm_comm"
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    lock.touch()
    yield lock


def _learner(model: Path, redis_url: str, tmp_path: Path, *overrides: str) -> subprocess.Popen[str]:
    args = [f"model={model}", f"run_dir={tmp_path / 'run'}", f"bus.url={redis_url}", *overrides]
    args += [f"sync.port={free_port()}", "sync.http_port=0"]  # never a port another run may hold
    command = [sys.executable, "-m", "sparkrl.cli", "learner", "--preset", "smoke"]
    for override in args:
        command += ["--set", override]
    env = clean_env() | {"TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}  # shm_lock's copy
    return subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)


def _read_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    seen, deadline = "", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        seen += line
        if marker in seen:
            return seen
    raise AssertionError(f"{marker!r} not seen in {timeout_s:.0f}s; stderr:\n{seen[-3000:]}")


def test_a_stale_build_lock_is_cleared_and_the_learner_starts(
    tiny_model_dir: Path,  # noqa: F811
    redis_url: str,
    tmp_path: Path,
    shm_lock: Path,
) -> None:
    proc = _learner(tiny_model_dir, redis_url, tmp_path)
    try:
        seen = _read_until(proc, "learner up", timeout_s=240)
        assert f"removing a stale build lock {shm_lock}" in seen
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.kill()


def test_a_start_stuck_on_a_held_lock_ends_with_the_reason(
    tiny_model_dir: Path,  # noqa: F811
    redis_url: str,
    tmp_path: Path,
    shm_lock: Path,
) -> None:
    builder = subprocess.Popen(["sleep", "120"], cwd=shm_lock.parent)  # a build "under way": not stale
    proc = _learner(tiny_model_dir, redis_url, tmp_path, "learner.startup_timeout_s=8")
    try:
        assert proc.wait(120) == 3
        err = proc.stderr.read()
        assert "did not start within 8 s (learner.startup_timeout_s)" in err
        assert f"build locks present: {shm_lock}" in err
    finally:
        proc.kill()
        builder.kill()
        builder.wait()


def test_the_start_clock_counts_from_the_process_start_imports_included() -> None:
    """The first phase begins when the process did (the kernel's clock), not when the clock was made."""
    code = (
        "import time; time.sleep(0.4)\n"
        "from sparkrl.services.common.start_clock import StartClock\n"
        "clock = StartClock(); clock.mark('imports'); time.sleep(0.2); clock.mark('model')\n"
        "print(clock.phases['imports'], clock.phases['model'], clock.total)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imports, model, total = map(float, done.stdout.split())
    assert 0.4 <= imports < 5 and 0.2 <= model < 2 and total == pytest.approx(imports + model, abs=0.02)


def test_the_op_is_built_with_the_interpreters_own_ninja_whatever_path(tmp_path: Path) -> None:
    """(issue 36, item 1) `make demo` runs `.venv/bin/sparkrl` with the venv not on PATH (the system's
    ninja 1.11), a shell with the venv activated finds the venv's (1.13): their build logs differ, so each
    switch rebuilt DeepSpeed's op (23-37 s). The learner puts its interpreter's bin/ first before the build:
    torch's build then runs one ninja whichever way the user started."""
    own = Path(sys.executable).parent
    if not (own / "ninja").exists():
        pytest.skip(f"no ninja beside {sys.executable}: nothing to pin (DeepSpeed's install brings one)")
    code = (
        "import shutil, subprocess\n"
        "from sparkrl.services.learner.startup import pin_build_tools\n"
        "pin_build_tools()\n"
        "version = subprocess.run(['ninja', '--version'], capture_output=True, text=True).stdout\n"
        "print(shutil.which('ninja'), version)"
    )
    found = set()
    for path in ("/usr/bin:/bin", f"{own}:/usr/bin:/bin", f"/usr/bin:{own}:/bin"):
        env = {"PATH": path, "HOME": str(tmp_path)}
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        )
        found.add(done.stdout.strip())
    assert len(found) == 1 and next(iter(found)).startswith(str(own / "ninja")), found
