"""Weight publishing: announce each new policy in Redis, then broadcast it to the fleet, off the main loop.

A thread, so training never waits on the fleet: it always sends the newest version it was handed
(versions produced while a broadcast runs are skipped, not queued). Membership is decided per broadcast:
the workers with a live heartbeat, minus those that recently failed to join. Any change, or any failed
broadcast, forms a new group epoch; the weight-sync layer's timeouts mean a dead or hung worker costs at
most `sync.timeout_s` and never hangs the learner.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from sparkrl.proto import WorkerStatus
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import WeightSyncSettings
from sparkrl.services.common.weight_sync import SyncFailed, WeightSender

log = logging.getLogger("sparkrl.learner.publisher")

ANNOUNCEMENT_KEY = "weights"  # bus value holding the latest WeightAnnouncement (JSON)
WORKER_STATUS_KIND = "worker"
SNAPSHOT_NAME = "latest.safetensors"


@dataclass(frozen=True)
class SyncRecord:
    """The last broadcast that went through."""

    version: int
    epoch: int
    members: tuple[str, ...]
    seconds: float
    bytes: int


def live_workers(bus: RedisBus) -> dict[str, WorkerStatus]:
    """Workers whose heartbeat has not expired and that are not shutting down."""
    workers = {}
    for worker_id, raw in bus.statuses(WORKER_STATUS_KIND).items():
        try:
            status = WorkerStatus.model_validate_json(raw)
        except ValueError:
            log.warning("ignoring malformed status of %s", worker_id)
            continue
        if status.state != "stopping":
            workers[worker_id] = status
    return workers


def write_snapshot(tensors: dict[str, torch.Tensor], version: int, directory: Path) -> Path:
    """The weights a late joiner loads, written atomically (temp file + rename) with their version."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SNAPSHOT_NAME
    tmp = directory / f".{SNAPSHOT_NAME}.{os.getpid()}.tmp"
    save_file(
        {name: t.contiguous() for name, t in tensors.items()}, str(tmp), metadata={"version": str(version)}
    )
    os.replace(tmp, path)
    return path


class WeightPublisher(threading.Thread):
    """`submit(version, tensors)` from the training loop; the thread announces and broadcasts."""

    def __init__(self, bus: RedisBus, cfg: WeightSyncSettings, snapshot_dir: Path) -> None:
        super().__init__(name="weight-publisher", daemon=True)
        self.bus, self.cfg, self.snapshot_dir = bus, cfg, snapshot_dir
        self.sender = WeightSender(
            cfg.host, cfg.port, backend=cfg.backend, timeout_s=cfg.timeout_s, bucket_bytes=cfg.bucket_mb << 20
        )
        self.epoch = 0
        self.members: tuple[str, ...] = ()
        self.needs_new_epoch = True
        self.excluded: dict[str, float] = {}  # worker → until when (monotonic) it is left out
        self.last_sync: SyncRecord | None = None
        self._pending: tuple[int, dict[str, torch.Tensor], bool] | None = None
        self._wake = threading.Condition()
        self._busy = False
        self._closing = False

    def submit(self, version: int, tensors: dict[str, torch.Tensor], broadcast: bool = True) -> None:
        """Hand over a new version (CPU tensors the caller will not modify); replaces any unsent one.
        `broadcast=False` only announces it (and snapshots it): for weights the fleet already holds."""
        with self._wake:
            self._pending = (version, tensors, broadcast)
            self._wake.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted version has been published (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._wake:
            while self._pending is not None or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._wake.wait(remaining)
        return True

    def close(self, timeout_s: float | None = None) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        self.join(timeout_s if timeout_s is not None else self.cfg.timeout_s * 3)
        self.sender.close()

    def run(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closing:
                    self._wake.wait()
                if self._pending is None:
                    return
                version, tensors, broadcast = self._pending
                self._pending, self._busy = None, True
            try:
                self.publish(version, tensors, broadcast)
            except Exception:  # the learner must outlive any publishing failure; the next version retries
                log.exception("publishing version %d failed", version)
                self.needs_new_epoch = True
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def choose_members(self) -> tuple[str, ...]:
        now = time.monotonic()
        self.excluded = {w: until for w, until in self.excluded.items() if until > now}
        return tuple(sorted(w for w in live_workers(self.bus) if w not in self.excluded))

    def publish(self, version: int, tensors: dict[str, torch.Tensor], broadcast: bool = True) -> None:
        snapshot = None
        if version % self.cfg.snapshot_every == 0 or not broadcast:
            snapshot = str(write_snapshot(tensors, version, self.snapshot_dir))
        members = self.choose_members() if broadcast else ()
        if members != self.members or self.needs_new_epoch:
            self.epoch += 1
            self.members, self.needs_new_epoch = members, False
        announcement = self.sender.announce(
            tensors, version=version, epoch=self.epoch, members=list(members), snapshot_path=snapshot
        )
        # Announce first: workers learn of the version (and of the snapshot) before the collective starts.
        self.bus.set_value(ANNOUNCEMENT_KEY, announcement.model_dump_json())
        if not members:
            return
        try:
            report = self.sender.broadcast(tensors, announcement)
        except SyncFailed as exc:
            self.needs_new_epoch = True
            for worker in exc.missing:
                self.excluded[worker] = time.monotonic() + 2 * self.cfg.timeout_s
            log.warning("broadcast of version %d failed (%s); dropping %s", version, exc, exc.missing or "-")
            return
        self.last_sync = SyncRecord(version, self.epoch, members, report.seconds, report.bytes)
        log.info(
            "version %d → %d workers in %.2fs (%.2f GB/s)", version, len(members), report.seconds, report.gbps
        )
