"""A worker's weight sync against a real sender, bus and engine: the races between the snapshot file, the
announcement and the broadcast group.

The snapshot file is written before its announcement, so a worker catching up can load a version newer
than the announcement it read; when the next announcement names it as a member of that very version's
epoch, it must still join (the learner waits for every member). And an epoch a worker failed in is dead:
it catches up from the snapshot instead of knocking on it again. An epoch that is over (read late, or
written back: a replay) fails at once, before joining, and the worker catches up from the snapshot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _tiny import tiny_model_dir  # noqa: F401  (fixture)

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import BusSettings, TorchEngineSettings
from sparkrl.services.common.weight_sync import EpochOver, SyncFailed, WeightReceiver, WeightSender
from sparkrl.services.learner.publisher import ANNOUNCEMENT_KEY, write_snapshot
from sparkrl.services.rollout.announcements import AnnouncementGate
from sparkrl.services.rollout.heartbeat import WorkerState
from sparkrl.services.rollout.install import VersionInstaller
from sparkrl.services.rollout.metrics import WorkerMetrics
from sparkrl.services.rollout.torch_engine import TorchEngine
from sparkrl.services.rollout.worker import sync_weights

WORKER = "worker-under-test"
TIMEOUT_S = 5.0


@pytest.fixture
def engine(tiny_model_dir: Path) -> Iterator[TorchEngine]:  # noqa: F811
    engine = TorchEngine(tiny_model_dir, TorchEngineSettings())
    yield engine
    engine.close()


def _weights(engine: TorchEngine, version: int) -> dict[str, torch.Tensor]:
    """The engine's parameters shifted by `version`: each version's weights differ from the others'."""
    return {name: p.detach().clone() + 0.01 * version for name, p in engine.model.named_parameters()}


class _Learner:
    """The learner's side, as the publisher does it: snapshot, announce in Redis, then broadcast."""

    def __init__(self, bus: RedisBus, snapshots: Path) -> None:
        self.bus, self.snapshots = bus, snapshots
        self.sender = WeightSender(timeout_s=TIMEOUT_S, straggler_s=TIMEOUT_S)
        self.outcome: list[object] = []

    def announce(
        self, tensors: dict[str, torch.Tensor], version: int, epoch: int, members: list[str]
    ) -> WeightAnnouncement:
        snapshot = write_snapshot(tensors, version, self.snapshots)
        announcement = self.sender.announce(
            tensors, version=version, epoch=epoch, members=members, snapshot_path=str(snapshot)
        )
        self.bus.set_value(ANNOUNCEMENT_KEY, announcement.model_dump_json())
        self.sender.published(announcement)
        return announcement

    def broadcast_in_background(
        self, tensors: dict[str, torch.Tensor], announcement: WeightAnnouncement
    ) -> threading.Thread:
        def run() -> None:
            try:
                self.outcome.append(self.sender.broadcast(tensors, announcement))
            except SyncFailed as exc:
                self.outcome.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def test_a_member_that_caught_up_from_a_newer_snapshot_still_joins_and_a_dead_epoch_is_not_rejoined(
    engine: TorchEngine, bus_settings: BusSettings, tmp_path: Path
) -> None:
    bus = RedisBus(bus_settings)
    learner = _Learner(bus, tmp_path / "snapshots")
    gate = AnnouncementGate(bus, None, tmp_path)
    receiver = WeightReceiver(WORKER, timeout_s=TIMEOUT_S)
    installer = VersionInstaller(engine, ".")
    state, metrics = WorkerState(WORKER, "torch"), WorkerMetrics(WORKER)
    try:
        # Version 1 was announced before we heartbeated (no members); version 2's snapshot is already on
        # disk when we read version 1's announcement: catching up loads version 2.
        v1, v2 = _weights(engine, 1), _weights(engine, 2)
        learner.announce(v1, version=1, epoch=1, members=[])
        write_snapshot(v2, 2, learner.snapshots)
        assert sync_weights(gate, receiver, installer, state, metrics, None)
        assert engine.policy_version == 2

        # Version 2's announcement names us in a new epoch: we hold the version, but must join.
        announcement = learner.announce(v2, version=2, epoch=2, members=[WORKER])
        broadcast = learner.broadcast_in_background(v2, announcement)
        assert sync_weights(gate, receiver, installer, state, metrics, None)
        broadcast.join(TIMEOUT_S * 3)
        assert not isinstance(learner.outcome[-1], SyncFailed), learner.outcome[-1]
        assert receiver.held_epoch == 2
        assert not sync_weights(gate, receiver, installer, state, metrics, None)  # nothing new: no rejoin

        # Version 3's epoch fails (a member that never joins): we fail with it, then catch up from the
        # snapshot rather than knock on the dead epoch again.
        v3 = _weights(engine, 3)
        announcement = learner.announce(v3, version=3, epoch=3, members=[WORKER, "never-joins"])
        broadcast = learner.broadcast_in_background(v3, announcement)
        assert not sync_weights(gate, receiver, installer, state, metrics, None)
        broadcast.join(TIMEOUT_S * 3)
        assert isinstance(learner.outcome[-1], SyncFailed) and learner.outcome[-1].missing == ["never-joins"]
        assert state.sync_failures == 1 and receiver.failed_epoch == 3
        assert sync_weights(gate, receiver, installer, state, metrics, None)
        assert engine.policy_version == 3 and state.sync_failures == 1
        assert state.weights_checksum == announcement.checksum
    finally:
        receiver.close()
        learner.sender.close()
        bus.close()


def test_an_epoch_that_is_over_fails_at_once_and_the_worker_catches_up_from_the_snapshot(
    engine: TorchEngine, bus_settings: BusSettings, tmp_path: Path
) -> None:
    """A worker read epoch 1's announcement while it was current; epoch 2 went on since, and epoch 1's
    announcement is written back into Redis (a replay it cannot tell from the one it saw). Its join fails
    at once — not after `sync.timeout_s` — and it loads the snapshot, as a late joiner does. A process that
    restarted under the id of a member of the running epoch cannot join it either, and learns so at once."""
    bus = RedisBus(bus_settings)
    learner = _Learner(bus, tmp_path / "snapshots")
    gate = AnnouncementGate(bus, None, tmp_path)
    before = WeightReceiver(WORKER, timeout_s=TIMEOUT_S)  # the process this one restarted from
    receiver = WeightReceiver(WORKER, timeout_s=TIMEOUT_S)
    installer = VersionInstaller(engine, ".")
    state, metrics = WorkerState(WORKER, "torch"), WorkerMetrics(WORKER)
    try:
        v1, v2 = _weights(engine, 1), _weights(engine, 2)
        first = learner.announce(v1, version=1, epoch=1, members=[WORKER])
        assert gate.latest() == first  # read while current; the worker generates before it syncs
        broadcast = learner.broadcast_in_background(v1, first)
        assert before.receive(first) is not None  # the process before this one, same id, joined epoch 1
        broadcast.join(TIMEOUT_S * 3)
        started = time.monotonic()
        with pytest.raises(EpochOver, match="epoch 1 started without this process"):
            receiver.receive(first)  # same id, another process: epoch 1 formed its link without it
        assert time.monotonic() - started < 1.0
        before.close()

        learner.announce(v2, version=2, epoch=2, members=[])  # epoch 2 (version 2's snapshot on disk)
        bus.set_value(ANNOUNCEMENT_KEY, first.model_dump_json())  # epoch 1's, written back
        receiver = WeightReceiver(WORKER, timeout_s=TIMEOUT_S)
        started = time.monotonic()
        assert sync_weights(gate, receiver, installer, state, metrics, None)
        assert time.monotonic() - started < TIMEOUT_S / 2
        assert engine.policy_version == 2  # the snapshot, not epoch 1's broadcast
        assert receiver.failed_epoch == 1 and state.sync_failures == 0
        again = sync_weights(gate, receiver, installer, state, metrics, None)
        assert not again  # and it does not knock again
    finally:
        receiver.close()
        before.close()
        learner.sender.close()
        bus.close()
