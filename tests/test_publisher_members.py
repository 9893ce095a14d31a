"""Who a broadcast goes to: live heartbeats, minus workers shutting down, recently failed, or whose loop
makes no progress while their heartbeat thread lives; and why each previous member is out. Workers are
left out the way the learner learns of them: a stuck loop in their heartbeat, a version they refused."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from sparkrl.proto import WeightAnnouncement, WorkerStatus
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import BusSettings, WeightSyncSettings
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.common.weight_sync import SyncFailed, WeightReceiver
from sparkrl.services.learner.publisher import ANNOUNCEMENT_KEY, SNAPSHOT_NAME, WeightPublisher
from sparkrl.services.rollout.announcements import AnnouncementGate


def status(
    worker_id: str, state: str = "generating", progress_age_s: float = 0.0, started_at: float | None = None
) -> WorkerStatus:
    now = time.time()
    return WorkerStatus(
        started_at=started_at,
        worker_id=worker_id,
        engine="torch",
        state=state,
        tokens_per_s=1.0,
        groups_published=0,
        prompts_in_flight=0,
        progress_at=now - progress_age_s,
        heartbeat_at=now,
    )


def test_members_and_why_the_others_are_out(bus_settings: BusSettings, tmp_path: Path) -> None:
    bus = RedisBus(bus_settings)
    telemetry = Telemetry(bus)
    from conftest import free_port

    cfg = WeightSyncSettings(port=free_port(), progress_timeout_s=30.0)
    publisher = WeightPublisher(telemetry, cfg, tmp_path)
    for worker in (status("a"), status("b"), status("c", progress_age_s=120), status("d", state="stopping")):
        telemetry.put_worker(worker, ttl_s=30)
    members, dropped = publisher.choose_members()
    assert members == ("a", "b")  # c's heartbeat lives but its loop is stuck; d is shutting down
    assert "no progress" in publisher.excluded["c"][1]
    publisher.members = ("a", "b", "c", "d", "e")  # the previous broadcast's
    members, dropped = publisher.choose_members()
    assert dropped == {
        "c": "left out until it recovers: no progress in its loop (hung generation?)",
        "d": "stopping",
        "e": "heartbeat expired",
    }
    # Mid-broadcast, a member that says `stopping` (Ctrl-C, a stop command) or whose heartbeat expired is
    # known gone: the acknowledgement wait cuts it at once instead of waiting for its heartbeat to expire.
    assert publisher.sender.gone(("a", "b", "c", "d", "e")) == {"d", "e"}
    publisher.sender.close()
    bus.close()


def _refuses_the_next_version(bus: RedisBus, run_dir: Path, worker_id: str) -> threading.Thread:
    """A worker that joins the next broadcast and refuses the version (its engine answers another
    checksum, as a vLLM engine that did not take it does): the learner leaves it out."""
    gate = AnnouncementGate(bus, None, run_dir)
    receiver = WeightReceiver(worker_id, timeout_s=30.0, install=lambda tensors, announcement: "0" * 64)

    def run() -> None:
        deadline = time.monotonic() + 30.0
        while (announcement := gate.latest()) is None or worker_id not in announcement.members:
            assert time.monotonic() < deadline, "no broadcast named this worker"
            time.sleep(0.01)
        with pytest.raises(SyncFailed, match="checksum mismatch"):
            receiver.receive(announcement)
        receiver.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_restarted_worker_under_the_same_id_is_admitted_again(
    bus_settings: BusSettings, tmp_path: Path
) -> None:
    """A container restarted in place keeps its id (hostname-pid, pid 1): its new incarnation is admitted
    at once; the same incarnation coming back (a SIGSTOP lifted) waits out its exclusion."""
    from conftest import free_port

    bus = RedisBus(bus_settings)
    telemetry = Telemetry(bus)
    publisher = WeightPublisher(telemetry, WeightSyncSettings(port=free_port(), timeout_s=30.0), tmp_path)
    telemetry.put_worker(status("w", started_at=100.0), ttl_s=30)
    telemetry.put_worker(status("z", started_at=100.0), ttl_s=30)
    refusing = [_refuses_the_next_version(bus, tmp_path, worker) for worker in ("w", "z")]
    publisher.publish(1, {"layer.weight": torch.arange(6.0)})
    for thread in refusing:
        thread.join(60)
    assert publisher.members == ("w", "z") and set(publisher.excluded) == {"w", "z"}
    assert publisher.excluded["w"][1] == "checksum mismatch"
    telemetry.put_worker(status("z", started_at=100.0), ttl_s=30)  # the same process, back
    telemetry.put_worker(status("w", started_at=200.0), ttl_s=30)  # a new process, same id
    members, _ = publisher.choose_members()
    assert members == ("w",)
    assert "z" in publisher.excluded and "w" not in publisher.excluded
    publisher.sender.close()
    bus.close()


def test_a_version_handed_over_twice_is_broadcast_once(bus_settings: BusSettings, tmp_path: Path) -> None:
    """A resumed learner's replay publishes the version it ends on, then the learner publishes the version it
    starts from: the same one. Sent twice in one epoch, the member (holding it, in that epoch's link) would
    take no part, and the learner would wait out `sync.timeout_s` and leave it out."""
    from conftest import free_port

    bus = RedisBus(bus_settings)
    telemetry = Telemetry(bus)
    events = []
    cfg = WeightSyncSettings(port=free_port(), timeout_s=5.0)
    publisher = WeightPublisher(telemetry, cfg, tmp_path, on_sync=events.append)
    telemetry.put_worker(status("w"), ttl_s=30)
    gate, receiver = AnnouncementGate(bus, None, tmp_path), WeightReceiver("w", timeout_s=30.0)
    received = []

    def worker() -> None:
        deadline = time.monotonic() + 30.0
        while (announcement := gate.latest()) is None or announcement.version != 5:
            assert time.monotonic() < deadline, "version 5 was never announced"
            time.sleep(0.01)
        received.append(receiver.receive(announcement))

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    publisher.start()
    weights = {"layer.weight": torch.arange(6.0)}
    publisher.submit(5, weights)
    thread.join(60)
    assert publisher.flush(30) and len(received) == 1
    publisher.submit(5, weights)  # the same version again: nothing to send
    assert publisher.flush(30)
    publisher.submit(6, {"layer.weight": torch.arange(6.0) + 1}, broadcast=False)  # announced, not sent
    assert publisher.flush(30)
    assert [(e.version, e.outcome) for e in events] == [(5, "ok")] and publisher.excluded == {}
    assert gate.latest() is not None and gate.latest().version == 6
    publisher.close()
    receiver.close()
    bus.close()


def test_a_snapshot_that_cannot_be_written_is_named_and_the_broadcast_goes_on(
    bus_settings: BusSettings, tmp_path: Path
) -> None:
    """A full disk (here: a file where the snapshots folder should be) costs the snapshot, named on the
    status, not the version: it is announced all the same, and the next snapshot that is written clears it."""
    from conftest import free_port

    blocked = tmp_path / "snapshots"
    blocked.write_text("a file where the folder should be\n")
    with RedisBus(bus_settings) as bus:
        publisher = WeightPublisher(Telemetry(bus), WeightSyncSettings(port=free_port()), blocked)
        try:
            publisher.publish(1, {"w": torch.ones(2)}, broadcast=False)
            assert publisher.snapshot_failure is not None
            assert publisher.snapshot_failure.startswith("the snapshot of version 1 could not be written: [")
            announced = WeightAnnouncement.model_validate_json(bus.get_value(ANNOUNCEMENT_KEY) or b"")
            assert announced.version == 1 and announced.snapshot_path is None
            blocked.unlink()
            publisher.publish(2, {"w": torch.ones(2)}, broadcast=False)
            assert publisher.snapshot_failure is None and (blocked / SNAPSHOT_NAME).is_file()
        finally:
            publisher.sender.close()
