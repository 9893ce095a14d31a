"""A genuine, signed weight announcement written back later (a replay) is never followed: each carries the
learner's incarnation and a sequence number inside what is signed, and a worker follows only what is at
least as fresh as the newest it has seen — or, having seen nothing of that learner yet (it just restarted),
what the learner's own store says is current. On a private redis-server with real senders' stores, then
on the real stack (a replay while a worker restarts)."""

from __future__ import annotations

import itertools
import json
import logging
import time
from pathlib import Path

import pytest
import torch
from _faults import assert_exactly_once, kill9, settings, steps_done, wait
from _live import Live
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import start_stack

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.proto import WeightAnnouncement, sign_announcement
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import BusSettings
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.common.weight_sync import WeightSender
from sparkrl.services.rollout import announcements
from sparkrl.services.rollout.announcements import ANNOUNCEMENT_KEY, AnnouncementGate

SECRET = "replay-test-secret-0123456789abcdef"


def _announce(sender: WeightSender, version: int, epoch: int = 1) -> WeightAnnouncement:
    tensors = {"w": torch.full((4,), float(version))}
    announcement = sender.announce(tensors, version=version, epoch=epoch, members=[])
    return sign_announcement(announcement, SECRET)


def _publish(bus: RedisBus, sender: WeightSender, announcement: WeightAnnouncement) -> None:
    """As the learner's publisher does: into Redis, then recorded as current in the learner's store."""
    bus.set_value(ANNOUNCEMENT_KEY, announcement.model_dump_json())
    sender.published(announcement)


def test_the_gate_refuses_a_replay_and_follows_a_restarted_learner(
    bus_settings: BusSettings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, restarted = WeightSender(secret=SECRET), None
    with RedisBus(bus_settings) as bus:
        gate = AnnouncementGate(bus, SECRET, tmp_path)

        def write(
            announcement: WeightAnnouncement, by: WeightSender | None = None
        ) -> WeightAnnouncement | None:
            """`by`: published by that learner; None: written back by someone else (a replay)."""
            if by is None:
                bus.set_value(ANNOUNCEMENT_KEY, announcement.model_dump_json())
            else:
                _publish(bus, by, announcement)
            return gate.latest()

        try:
            v1, v2 = _announce(first, 1), _announce(first, 2)
            assert write(v1, first) == v1 and write(v2, first) == v2
            assert gate.latest() == v2  # the same announcement read again is still the current one
            with caplog.at_level(logging.ERROR, logger="sparkrl.rollout"):
                assert write(v1) is None  # genuine, signed, and older: a replay
            assert "version 1 (announcement 0) is older than version 2 (announcement 1)" in caplog.text
            assert "replayed" in caplog.text
            again = _announce(first, 2, epoch=2)  # version 2 again, for a new group epoch: fresh
            assert write(again, first) == again

            # A learner restarted (resumed to an older version): followed back.
            restarted = WeightSender(secret=SECRET)
            back = _announce(restarted, 1)
            assert back.incarnation > v2.incarnation and write(back, restarted) == back
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="sparkrl.rollout"):
                assert write(_announce(first, 3), first) is None  # the old incarnation, even a newer version
            assert "earlier learner incarnation" in caplog.text
            # The freshness is part of what is signed: it cannot be edited past the check.
            forged = back.model_copy(update={"sequence": back.sequence + 10})
            assert write(forged) is None
        finally:
            first.close()
            if restarted is not None:
                restarted.close()


@pytest.mark.slow
def test_a_replayed_announcement_on_the_live_stack_is_refused_and_the_fleet_stays_in_the_broadcast(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """Pause the run at a step boundary (no announcement is written meanwhile), write back the signed
    announcement of an older version, let every worker see it, resume: each worker refuses it with the
    reason, every later broadcast reaches both workers, and every group is trained exactly once."""
    steps, per_step = 10, 4
    cfg = settings(
        tiny_model_dir,
        tmp_path / "run",
        f"learner.max_steps={steps}",
        f"learner.prompts_per_step={per_step}",
        f"prompts.count={steps * per_step}",
        f"sync.secret={SECRET}",
        "control.command_timeout_s=60",
    )
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    live = Live(plan, stack, plan.settings.control.url, plan.token_path.read_text().strip())
    with RedisBus(plan.settings.bus) as bus:
        wait("step 2", lambda: steps_done(plan.run_dir) >= 2, plan.run_dir)
        old = bus.get_value(ANNOUNCEMENT_KEY)
        assert old is not None
        wait("step 4", lambda: steps_done(plan.run_dir) >= 4, plan.run_dir)
        assert live.send("POST", "/api/v1/pause").status_code == 200
        # The learner's last version before the pause goes out on the publisher's thread: once its
        # broadcast is done, no genuine announcement is written until the resume.
        version = int(live.get("/api/v1/status")["policy_version"])

        def broadcast_done() -> bool:
            syncs = (plan.run_dir / "weights.jsonl").read_text().splitlines()
            return bool(syncs) and json.loads(syncs[-1])["version"] == version

        wait(f"version {version}'s broadcast", broadcast_done, plan.run_dir)
        replayed = WeightAnnouncement.model_validate_json(old)
        paused_at = WeightAnnouncement.model_validate_json(bus.get_value(ANNOUNCEMENT_KEY) or b"")
        assert replayed.version < paused_at.version == version
        bus.set_value(ANNOUNCEMENT_KEY, old)
        refusal = f"refusing a weight announcement: version {replayed.version} (announcement"
        logs = [plan.run_dir / "logs" / f"worker-{i}.log" for i in range(2)]
        wait(
            "both workers to refuse the replay",
            lambda: all(refusal in log.read_text(errors="replace") for log in logs),
            plan.run_dir,
        )
        assert live.send("POST", "/api/v1/resume").status_code == 200
        learner = stack.procs["learner"]
        wait("the learner to finish", lambda: learner.poll() is not None, plan.run_dir)
        assert learner.returncode == 0
    syncs = [json.loads(line) for line in (plan.run_dir / "weights.jsonl").read_text().splitlines()]
    after = [e for e in syncs if e["version"] > paused_at.version]
    assert after and all(e["outcome"] == "ok" and not e["dropped"] for e in after), after
    assert all(sorted(e["acknowledged"]) == ["worker-0", "worker-1"] for e in after), after
    for log in logs:  # after refusing the replay, no worker follows it (whatever it followed before)
        after_refusal = log.read_text().split(refusal, 1)[1]
        assert f"now on policy version {replayed.version} " not in after_refusal
    assert_exactly_once(plan, steps)


def test_a_worker_with_no_history_asks_the_learners_store_and_refuses_a_replay(
    bus_settings: BusSettings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fresh gate (a worker just restarted) has nothing to compare with: the learner's store says what is
    current. A replay of an older announcement of the live learner is refused, and so is one of a learner
    whose store serves another learner now; the current one is followed. A learner that is gone leaves
    no epoch to join: its last announcement is followed at once (a late joiner loads its snapshot)."""
    learner = WeightSender(secret=SECRET)
    successor: WeightSender | None = None
    with RedisBus(bus_settings) as bus:
        try:
            old, current = _announce(learner, 1), _announce(learner, 2, epoch=2)
            _publish(bus, learner, old)
            _publish(bus, learner, current)
            bus.set_value(ANNOUNCEMENT_KEY, old.model_dump_json())  # the replay
            fresh = AnnouncementGate(bus, SECRET, tmp_path)
            with caplog.at_level(logging.ERROR, logger="sparkrl.rollout"):
                assert fresh.latest() is None and fresh.latest() is None  # refused, and said once
            said = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
            assert said == [
                "refusing a weight announcement: version 1 (announcement 0) is older than the learner's "
                "current announcement 1, as its store says: a replayed announcement"
            ]
            bus.set_value(ANNOUNCEMENT_KEY, current.model_dump_json())
            assert fresh.latest() == current

            # The learner is gone and another took its store's port (sync.port is fixed): an announcement
            # of the old one names a store that serves the new one.
            port = learner.port
            learner.close()
            del learner
            late = AnnouncementGate(bus, SECRET, tmp_path)
            bus.set_value(ANNOUNCEMENT_KEY, current.model_dump_json())
            started = time.monotonic()
            assert late.latest() == current  # nothing answers there: followed, at once
            assert time.monotonic() - started < 2.0
            successor = WeightSender(port=port, secret=SECRET)
            assert successor.incarnation > current.incarnation
            _publish(bus, successor, _announce(successor, 1))
            bus.set_value(ANNOUNCEMENT_KEY, current.model_dump_json())
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="sparkrl.rollout"):
                assert AnnouncementGate(bus, SECRET, tmp_path).latest() is None
            assert "comes from a learner that is gone" in caplog.text
        finally:
            if successor is not None:
                successor.close()


def test_an_announcement_superseded_while_the_store_is_asked_is_not_called_a_replay(
    bus_settings: BusSettings,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fresh gate reads version 1, and while it asks the learner's store the learner publishes version 2
    (a worker starting while the learner trains): version 1 is no longer current, but it was not replayed.
    Nothing is refused or logged as an error; the next look follows version 2."""
    learner = WeightSender(secret=SECRET)
    with RedisBus(bus_settings) as bus:
        try:
            first, second = _announce(learner, 1), _announce(learner, 2, epoch=2)
            _publish(bus, learner, first)
            asked = announcements.ask_current

            def racing(host: str, port: int, timeout_s: float, secret: str | None) -> object:  # a step later
                _publish(bus, learner, second)
                return asked(host, port, timeout_s, secret)

            monkeypatch.setattr(announcements, "ask_current", racing)
            gate = AnnouncementGate(bus, SECRET, tmp_path)
            with caplog.at_level(logging.DEBUG, logger="sparkrl.rollout"):
                assert gate.latest() is None
                monkeypatch.setattr(announcements, "ask_current", asked)
                assert gate.latest() == second
            assert "refusing" not in caplog.text
        finally:
            learner.close()


def _step_gaps(run_dir: Path, since: float) -> list[float]:
    """Seconds between consecutive step rows of metrics.jsonl written after `since` (Unix time), the first
    counted from `since`: how long each step after it took, waits included."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    times = [since] + [row["time"] for row in rows if row["time"] > since]
    return [b - a for a, b in itertools.pairwise(times)]


@pytest.mark.slow
def test_a_replay_during_a_worker_restart_is_refused_and_nothing_stalls(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """The replay-during-restart probe. Paused (no announcement is written meanwhile), worker-1 is killed
    and, while `sparkrl up`'s supervision restarts it, the signed announcement of an older epoch it was a
    member of is written back. The restarted worker has no history: it must refuse the replay (the
    learner's store says what is current) instead of joining that epoch, whose link formed without it;
    the learner forms a new epoch for the restarted process; after the resume no step takes longer than
    one broadcast timeout, every broadcast reaches both workers, and every group is trained once."""
    steps, per_step, timeout_s = 14, 4, 15.0
    cfg = settings(
        tiny_model_dir,
        tmp_path / "run",
        f"learner.max_steps={steps}",
        f"learner.prompts_per_step={per_step}",
        f"prompts.count={steps * per_step}",
        f"sync.secret={SECRET}",
        f"sync.timeout_s={timeout_s}",
        "control.command_timeout_s=60",
    )
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    live = Live(plan, stack, plan.settings.control.url, plan.token_path.read_text().strip())
    with RedisBus(plan.settings.bus) as bus:
        telemetry = Telemetry(bus)

        def both_members() -> bool:
            raw = bus.get_value(ANNOUNCEMENT_KEY)
            return raw is not None and len(WeightAnnouncement.model_validate_json(raw).members) == 2

        wait("an announcement to both workers", both_members, plan.run_dir)
        old = WeightAnnouncement.model_validate_json(bus.get_value(ANNOUNCEMENT_KEY) or b"")
        wait("step 4", lambda: steps_done(plan.run_dir) > old.version + 2, plan.run_dir)
        assert live.send("POST", "/api/v1/pause").status_code == 200
        version = int(live.get("/api/v1/status")["policy_version"])
        wait(f"version {version}'s broadcast", lambda: _broadcast_done(plan.run_dir, version), plan.run_dir)
        current = WeightAnnouncement.model_validate_json(bus.get_value(ANNOUNCEMENT_KEY) or b"")
        assert old.group_epoch < current.group_epoch or old.sequence < current.sequence

        log_path = plan.run_dir / "logs" / "worker-1.log"
        killed_at = time.time()
        kill9(stack, "worker-1")
        bus.set_value(ANNOUNCEMENT_KEY, old.model_dump_json())  # the replay, before the new process reads
        assert stack.poll() is None  # supervision restarts worker-1 from its config

        def restarted_log() -> str:
            return log_path.read_text(errors="replace").split("restarted ---", 1)[-1]

        def read_the_replay() -> bool:
            status = telemetry.workers().get("worker-1")
            started = status is not None and (status.started_at or 0) > killed_at
            return started and (
                "refusing a weight announcement" in restarted_log() or status.state == "syncing"
            )

        wait("the restarted worker-1 to read the replay", read_the_replay, plan.run_dir)
        resumed_at = time.time()
        assert live.send("POST", "/api/v1/resume").status_code == 200
        learner = stack.procs["learner"]
        wait("the learner to finish", lambda: stack.poll() is not None or learner.poll() is not None,
             plan.run_dir, timeout_s=400)  # fmt: skip
        assert learner.returncode == 0
    gaps = _step_gaps(plan.run_dir, resumed_at)
    print(f"step times after the resume (s): {[round(g, 1) for g in gaps]}")
    assert gaps and max(gaps) < timeout_s, gaps
    after = restarted_log()
    assert "refusing a weight announcement" in after and "replayed" in after, after[-3000:]
    # It never followed the replay, nor waited out a timeout in any epoch.
    assert f"now on policy version {old.version} " not in after
    assert f"weight sync of version {old.version} failed" not in after and "timed out" not in after
    # The learner formed a new epoch for the restarted process: every broadcast since reached both.
    syncs = [json.loads(line) for line in (plan.run_dir / "weights.jsonl").read_text().splitlines()]
    since = [e for e in syncs if e["version"] > current.version]
    assert since and all(e["outcome"] == "ok" for e in since), since
    assert all(sorted(e["acknowledged"]) == ["worker-0", "worker-1"] for e in since), since
    assert_exactly_once(plan, steps)


def _broadcast_done(run_dir: Path, version: int) -> bool:
    syncs = (run_dir / "weights.jsonl").read_text().splitlines()
    return bool(syncs) and json.loads(syncs[-1])["version"] == version
