"""Exactly-once against the faults an unlucky operator meets, on the real stack run as users run it
(`sparkrl up` as a process, its private redis-server, two workers, the DeepSpeed learner):

- Redis refusing writes mid-run (`CONFIG SET maxmemory` below what it holds), then taking them again;
- a second `sparkrl up` pointed at the live run's Redis and namespace;
- `kill -9` of `sparkrl up` itself, and `--resume` 5 s later, while its orphaned services still run.

Each ends with the audit that counts both records: the journal (read all along, before a resume trims
it) and the audit trail, every group id in exactly one step, and every group the bus accepted trained.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import yaml
from _faults import History, assert_each_group_once, journal_ids, steps_done, wait
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from _tmpfs import tmpfs

from sparkrl.proto import LearnerStatus
from sparkrl.services.common.bus import BusError, RedisBus
from sparkrl.services.common.settings import BusSettings
from sparkrl.services.common.telemetry import Telemetry

pytestmark = pytest.mark.slow

STEPS, PER_STEP = 24, 4


def up(model: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "sparkrl.cli", "up", "--preset", "smoke", "--run-dir", str(run_dir),
        "--set", f"model={model}", "--set", f"learner.max_steps={STEPS}",
        "--set", f"learner.prompts_per_step={PER_STEP}", "--set", f"prompts.count={STEPS * PER_STEP}",
        "--set", "learner.checkpoint_every=1000",  # the journal keeps every step until the run's end
        "--set", "learner.max_staleness=1000",  # nothing dropped as stale: every group is trained
        "--set", "bus.trajectory_maxlen=12", "--set", "bus.claim_idle_ms=2000", *extra,
    ]  # fmt: skip


def start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`sparkrl up` in its own session, as from a terminal: a SIGKILL reaches the launcher alone."""
    with log.open("ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def until(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Whether `condition` held within `timeout_s` (polled every 0.1 s)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


class JournalWatch(threading.Thread):
    """Reads the run's journal every 0.2 s and keeps every step it ever saw (a checkpoint trims it)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.seen, self.done = run_dir, dict[int, list[str]](), threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.read()

    def read(self) -> None:
        # A file trimmed while being read: the next look has the rest.
        with contextlib.suppress(OSError, ValueError):
            self.seen |= journal_ids(self.run_dir)


def published_after_the_run(run_dir: Path) -> set[str]:
    """Every group id the run's bus accepted: its private Redis started again from its append-only file."""
    conf = run_dir / "config" / "redis.conf"
    server = subprocess.Popen(["redis-server", str(conf)], stdout=subprocess.DEVNULL)
    url = yaml.safe_load((run_dir / "config" / "learner.yaml").read_text())["bus"]["url"]
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "the run's Redis did not come back from its AOF"
                time.sleep(0.1)
        prefix = "sparkrl:published:trajectories:"
        return {key.decode()[len(prefix) :] for key in client.scan_iter(match=prefix + "*", count=1000)}
    finally:
        client.close()
        server.terminate()
        server.wait(10)


def resume_and_audit(command: list[str], log: Path, watch: JournalWatch) -> None:
    """`sparkrl up --resume` to the run's end, then the audit: every step, every group in exactly one of
    them (the journal as `watch` saw it, and the audit trail), every group the bus accepted trained."""
    resumed = start(command, log)
    try:
        assert resumed.wait(400) == 0, log.read_text(errors="replace")[-4000:]
    finally:
        if resumed.poll() is None:
            os.killpg(resumed.pid, signal.SIGKILL)
        watch.done.set()
        watch.join(5)
    watch.read()
    history = History.read(watch.run_dir)
    assert sorted(history.steps) == list(range(1, STEPS + 1))
    assert_each_group_once(history, watch.seen)
    assert set(history.group_ids) == published_after_the_run(watch.run_dir)


def test_refused_writes_a_second_run_and_a_killed_launcher_train_every_group_once(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "up.log"
    first = start(up(tiny_model_dir, run_dir), log)
    watch = JournalWatch(run_dir)
    watch.start()
    procs = [first]
    try:
        wait("step 3", lambda: steps_done(run_dir) >= 3, run_dir)
        learner_cfg = yaml.safe_load((run_dir / "config" / "learner.yaml").read_text())
        url, run_id = learner_cfg["bus"]["url"], learner_cfg["bus"]["run_id"]

        # A second run on the live run's Redis and namespace: refused before anything is spawned.
        other = subprocess.run(
            up(tiny_model_dir, tmp_path / "other", "--set", f"bus.url={url}"),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        said = other.stdout + other.stderr
        assert other.returncode == 2, said
        assert "namespace 'sparkrl' on Redis" in said and f"is owned by run {run_id}" in said, said
        assert not (tmp_path / "other" / "logs").exists() or not any((tmp_path / "other" / "logs").iterdir())

        # Redis refuses every write for 5 s, then takes them again: the services wait, nothing is lost.
        raw = redis.Redis.from_url(url)
        limit = raw.config_get("maxmemory")["maxmemory"]
        raw.config_set("maxmemory", 1)
        time.sleep(5)
        raw.config_set("maxmemory", limit)
        raw.close()
        refused_at = steps_done(run_dir)
        wait("two steps after the refusal", lambda: steps_done(run_dir) >= refused_at + 2, run_dir)
        learner_log = (run_dir / "logs" / "learner.log").read_text(errors="replace")
        assert "refuses writes (OOM" in learner_log

        # `kill -9` of `sparkrl up` itself; `--resume` 5 s later, while its services may still be stopping.
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        killed_at = steps_done(run_dir)
        time.sleep(5)
        resumed = start(up(tiny_model_dir, run_dir, "--resume"), log)
        procs.append(resumed)
        assert resumed.wait(400) == 0, log.read_text(errors="replace")[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        watch.done.set()
        watch.join(5)
    watch.read()
    # The run is its user's alone: the directory 0700, every file in it (logs, AOF, journal) 0600.
    assert run_dir.stat().st_mode & 0o777 == 0o700
    shared = [p for p in run_dir.rglob("*") if p.stat().st_mode & 0o077 and not p.is_symlink()]
    assert not shared, f"readable by others: {[str(p.relative_to(run_dir)) for p in shared[:5]]}"

    history = History.read(run_dir)
    assert sorted(history.steps) == list(range(1, STEPS + 1)) and killed_at < STEPS
    assert_each_group_once(history, watch.seen)
    trained = set(history.group_ids)
    assert trained == published_after_the_run(run_dir) and len(trained) == STEPS * PER_STEP
    said = log.read_text(errors="replace")
    assert "ended:" in said
    # The orphaned learner finished its step and stopped on its parent-death signal, its Redis kept by the
    # keeper until then: a clean stop, not a lost Redis (`BusStopping`).
    learner_log = (run_dir / "logs" / "learner.log").read_text(errors="replace")
    assert re.search(r"learner stopped at step \d+ \(policy version \d+\): stopped \(signal\)", learner_log)
    assert "BusStopping" not in learner_log


def test_a_commit_refused_past_the_wait_is_never_checkpointed_and_resume_trains_it_once(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Redis refuses writes longer than `bus.reconnect_max_s` (3 s) while the learner commits a step: the
    step's journal is written, its marks are refused, the learner ends non-zero, and no checkpoint holds
    the step (before, the step was counted first and the final checkpoint held it: `--resume` then
    trained its groups again, which stayed pending). `--resume` redoes it from the journal, once."""
    run_dir, log = tmp_path / "run", tmp_path / "up.log"
    # The intake on the loop (learner.read_ahead_mb=0): the attack needs the commit to be the learner's first
    # write once Redis refuses them, and a read-ahead thread would write (read, keep alive) before it. With
    # read-ahead, a refusal ends the run at a read instead, which the other attacks here cover.
    reads = ("--set", "learner.read_ahead_mb=0")
    command = up(tiny_model_dir, run_dir, "--set", "bus.reconnect_max_s=3", *reads)
    first = start(command, log)
    watch = JournalWatch(run_dir)
    watch.start()
    try:
        wait("step 4", lambda: steps_done(run_dir) >= 4, run_dir)
        url = yaml.safe_load((run_dir / "config" / "learner.yaml").read_text())["bus"]["url"]
        raw = redis.Redis.from_url(url)
        # The learner held still until the workers have queued a step's groups, so that the first thing it
        # writes once Redis refuses writes is a commit (idle, it would fail reading the queue's depth).
        # Held mid-broadcast, it holds the workers too (they wait on its weight-sync store): let it go on
        # and try again.
        learner = json.loads((run_dir / "owner.json").read_text())["pid"]
        for _ in range(6):
            os.kill(learner, signal.SIGSTOP)
            try:
                if queued := until(lambda: raw.xlen("sparkrl:trajectories") >= 2 * PER_STEP, 15):
                    raw.config_set("maxmemory", 1)
            finally:
                os.kill(learner, signal.SIGCONT)
            if queued:
                break
            time.sleep(3)
        assert queued, "the workers never queued two steps' groups while the learner held still"
        assert first.wait(120) != 0, "a run whose learner cannot commit must not end as if it had"
        raw.close()  # its Redis went with it
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    learner_log = (run_dir / "logs" / "learner.log").read_text(errors="replace")
    assert "was not committed" in learner_log, learner_log[-3000:]
    ended = json.loads((run_dir / "ended.json").read_text())
    assert "was not committed" in ended["reason"] and "--resume" in ended["reason"]

    resume_and_audit(
        up(tiny_model_dir, run_dir, "--set", "bus.reconnect_max_s=3", *reads, "--resume"), log, watch
    )


@pytest.fixture
def small_run_disk(tmp_path: Path) -> Iterator[Path]:
    """The run directory on a real 64 MiB tmpfs."""
    with tmpfs(tmp_path / "run", "64m") as where:
        yield where


def learner_status(url: str) -> LearnerStatus | None:
    try:
        with RedisBus(BusSettings(url=url, block_ms=100, socket_timeout_s=1, reconnect_max_s=0.2)) as bus:
            return Telemetry(bus).learner()
    except (BusError, redis.RedisError):
        return None


def test_a_full_disk_stops_the_run_saying_why_and_resume_trains_every_group_once(
    small_run_disk: Path,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The run directory's disk fills up mid-run (a file takes all but 6 MiB of it): the learner stops at
    the next step boundary, below `learner.min_free_mb` (12), with the reason on its status and in
    `ended.json`, while there is still room to write them; `sparkrl up` says it and exits non-zero. Once
    the space is back, `--resume` finishes the run, every group trained once."""
    run_dir, log = small_run_disk, tmp_path / "up.log"
    first = start(up(tiny_model_dir, run_dir, "--set", "learner.min_free_mb=12"), log)
    watch = JournalWatch(run_dir)
    watch.start()
    filler = run_dir / "filler.bin"
    seen: LearnerStatus | None = None
    try:
        wait("step 3", lambda: steps_done(run_dir) >= 3, run_dir)
        url = yaml.safe_load((run_dir / "config" / "learner.yaml").read_text())["bus"]["url"]
        with filler.open("wb") as file:
            os.posix_fallocate(file.fileno(), 0, shutil.disk_usage(run_dir).free - 6 * 2**20)
        deadline = time.monotonic() + 120
        while first.poll() is None and time.monotonic() < deadline:
            status = learner_status(url)
            seen = status if status is not None and status.disk_failure else seen
            time.sleep(0.2)
        assert first.wait(30) == 1, log.read_text(errors="replace")[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert seen is not None and "learner.min_free_mb (12)" in (seen.disk_failure or "")
    ended = json.loads((run_dir / "ended.json").read_text())["reason"]
    assert "below learner.min_free_mb (12)" in ended and "--resume" in ended
    assert "ended: the disk of" in log.read_text(errors="replace")

    filler.unlink()  # the space comes back
    resume_and_audit(up(tiny_model_dir, run_dir, "--set", "learner.min_free_mb=12", "--resume"), log, watch)
