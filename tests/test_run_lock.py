"""The lock of a live run directory (issue 23, item 2), on the file system and real processes: held by one
process at a time, refused with who holds it since when, taken over once its holder is gone, never
taken from another host, kept by `--overwrite`. `test_finite_run.py` holds it to a live `sparkrl up`."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sparkrl.plan import earlier_run, prepare_run_dir
from sparkrl.proto.run_files import RunLock
from sparkrl.run_lock import LOCK_FILE, RunDirLive, live_holder, lock_run_dir, read_lock

# Another process taking the directory: prints once it holds it, keeps it until stdin closes.
HOLDER = (
    "import sys\nfrom pathlib import Path\nfrom sparkrl.run_lock import lock_run_dir\n"
    "with lock_run_dir(Path(sys.argv[1]), 'sparkrl up'):\n"
    "    print('held', flush=True)\n    sys.stdin.read()\n"
)


def _gone_pid() -> int:
    """The pid of a process that has exited (reaped): nothing runs under it now."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write(run_dir: Path, lock: RunLock) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_FILE).write_text(lock.model_dump_json())


def test_one_holder_at_a_time_and_the_refusal_says_who_since_when(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        held = live_holder(run_dir)
        assert held is not None and (held.pid, held.host) == (holder.pid, socket.gethostname())
        for resume, overwrite, words in (
            (False, False, "is live"),
            (True, False, "--resume joins a run only once it has stopped"),
            (False, True, "--overwrite never deletes a live run"),
        ):
            with pytest.raises(RunDirLive, match=words) as refused:
                lock_run_dir(run_dir, "sparkrl up", resume, overwrite)
            assert f"sparkrl up (pid {holder.pid} on host {socket.gethostname()}) since " in str(
                refused.value
            )
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
    assert live_holder(run_dir) is None and not (run_dir / LOCK_FILE).exists()  # released as it exited
    with lock_run_dir(run_dir, "sparkrl up") as mine:
        assert read_lock(run_dir) is not None and read_lock(run_dir).pid == os.getpid()  # type: ignore[union-attr]
        assert mine.took_over is None
    assert not run_dir.exists()  # made for the lock, left empty: removed with it


def test_up_on_ray_honours_the_lock_too(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        command = ["up", "--ray", "--preset", "smoke", "--run-dir", str(run_dir), "--overwrite"]
        done = subprocess.run(
            [sys.executable, "-m", "sparkrl.cli", *command], capture_output=True, text=True, timeout=120
        )
        said = " ".join(re.sub("[│╭╮╰╯─]", " ", done.stderr).split())
        assert (
            done.returncode == 2
            and f"pid {holder.pid} on host" in said
            and "never deletes a live run" in said
        )
        assert [p.name for p in run_dir.iterdir()] == [LOCK_FILE]  # nothing written, nothing deleted
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)


def test_a_stale_lock_is_taken_over_with_a_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    gone = RunLock(pid=_gone_pid(), host=socket.gethostname(), since=time.time() - 600, command="sparkrl up")
    _write(run_dir, gone)
    assert live_holder(run_dir) is None  # `sparkrl dead` and `report` see a run that is over
    said: list[str] = []
    with lock_run_dir(run_dir, "sparkrl up --ray", say=said.append) as lock:
        assert lock.took_over == gone
        assert read_lock(run_dir).command == "sparkrl up --ray"  # type: ignore[union-attr]
    assert said == [
        f"{run_dir}: taking over a stale lock (sparkrl up (pid {gone.pid} on host {gone.host}) since "
        f"{said[0].split(' since ')[1].split(',')[0]}, 10 min ago; that process is gone)"
    ]
    assert run_dir.is_dir()  # it existed before: kept


def test_a_pid_reused_by_another_process_is_not_the_holder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # This very process, but started at another time than the lock says: the holder is gone.
    _write(run_dir, RunLock(pid=os.getpid(), host=socket.gethostname(), pid_started=1, since=0, command="x"))
    assert live_holder(run_dir) is None
    with lock_run_dir(run_dir, "sparkrl up", say=lambda line: None) as lock:
        assert lock.took_over is not None


def test_a_lock_from_another_host_is_never_taken(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _write(run_dir, RunLock(pid=1, host="elsewhere.example", since=time.time(), command="sparkrl up"))
    assert live_holder(run_dir) is not None  # cannot tell from here: live
    with pytest.raises(RunDirLive, match=f"if that run is over .* delete {run_dir / LOCK_FILE}"):
        lock_run_dir(run_dir, "sparkrl up")


def test_overwrite_deletes_the_earlier_run_but_keeps_the_lock(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    with lock_run_dir(run_dir, "sparkrl up"):
        prepare_run_dir(run_dir, resume=False, overwrite=True)
        assert earlier_run(run_dir) == [] and [p.name for p in run_dir.iterdir()] == [LOCK_FILE]
        assert live_holder(run_dir) is not None


# A `sparkrl up` that spawned one service (a sleep) handing it the lock, as the launcher does; killed with
# SIGKILL it leaves the service running, holding the run.
SPAWNER = (
    "import subprocess, sys\nfrom pathlib import Path\nfrom sparkrl.run_lock import lock_run_dir\n"
    "lock = lock_run_dir(Path(sys.argv[1]), 'sparkrl up')\n"
    "child = subprocess.Popen(['sleep', '60'], pass_fds=(lock.fd,))\n"
    "print(child.pid, flush=True)\nsys.stdin.read()\n"
)


def test_the_services_of_a_killed_launcher_hold_the_run_until_they_are_gone(tmp_path: Path) -> None:
    """`kill -9` of `sparkrl up` frees nothing while a service it started still runs (an orphan learner
    must not write into a run another `up` goes on with): a second `up` waits for it, names it, and takes
    the run once it is gone."""
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-c", SPAWNER, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert launcher.stdout is not None
    service = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait()
    said: list[str] = []
    with pytest.raises(RunDirLive, match=rf"pid {service} \(sleep\) did not stop within 1 s"):
        lock_run_dir(run_dir, "sparkrl up", resume=True, say=said.append, orphans_wait_s=1)
    assert len(said) == 1 and f"pid {launcher.pid}" in said[0] and "waiting up to 1 s" in said[0]

    def stop_service_soon() -> None:
        time.sleep(0.5)
        os.kill(service, 9)

    threading.Thread(target=stop_service_soon, daemon=True).start()
    with lock_run_dir(run_dir, "sparkrl up", resume=True, say=said.append, orphans_wait_s=30) as lock:
        assert lock.took_over is not None and lock.took_over.pid == launcher.pid
