"""Weight publishing: announce each new policy in Redis, then broadcast it to the fleet, off the main loop.

A thread, so training never waits on the fleet: it always sends the newest version it was handed
(versions produced while a broadcast runs are skipped, not queued). Membership is decided per broadcast:
the workers with a live heartbeat, minus those that recently failed to join. Any change, or any failed
broadcast, forms a new group epoch; the weight-sync layer's timeouts mean a dead or hung worker costs at
most `sync.timeout_s` and never hangs the learner. Every broadcast becomes a `SyncEvent` (members, who
acknowledged, who was dropped and why), handed to `on_sync` for the telemetry channel.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from sparkrl.proto import SyncEvent, WeightAnnouncement, WorkerStatus, sign_announcement
from sparkrl.services.common.settings import WeightSyncSettings
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.common.weight_sync import ANNOUNCEMENT_KEY, SyncFailed, WeightSender
from sparkrl.services.common.weight_sync.files import WeightFileServer
from sparkrl.services.learner.disk import failed_write

log = logging.getLogger("sparkrl.learner.publisher")

__all__ = ["ANNOUNCEMENT_KEY", "SNAPSHOT_NAME", "WeightPublisher", "write_snapshot"]

SNAPSHOT_NAME = "latest.safetensors"


def _drop_reason(failure: SyncFailed, timeout_s: float) -> str:
    if failure.phase == "join":
        return f"did not join epoch {failure.epoch} within {timeout_s:g}s"
    if failure.reason == "checksum mismatch":
        return "checksum mismatch"
    if failure.reason.startswith("gone"):
        return "it stopped, or its heartbeat expired, mid-broadcast"
    if failure.reason == "stragglers cut off":
        return "no checksum acknowledgement while the others had theirs (sync.straggler_s)"
    if failure.phase == "verify":
        return f"no checksum acknowledgement within {timeout_s:g}s"
    return f"{failure.phase} failed: {failure}"


def write_snapshot(
    tensors: dict[str, torch.Tensor], version: int, directory: Path, adapter_base: str | None = None
) -> Path:
    """The weights a late joiner loads, written atomically (temp file + rename) with their version (and,
    for a LoRA adapter alone, the checksum of the base it applies to)."""
    metadata = {"version": str(version)} | ({"adapter_base": adapter_base} if adapter_base else {})
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SNAPSHOT_NAME
    tmp = directory / f".{SNAPSHOT_NAME}.{os.getpid()}.tmp"
    try:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not keep half a snapshot
        raise
    return path


class WeightPublisher(threading.Thread):
    """`submit(version, tensors)` from the training loop; the thread announces and broadcasts."""

    def __init__(
        self,
        telemetry: Telemetry,
        cfg: WeightSyncSettings,
        snapshot_dir: Path,
        on_sync: Callable[[SyncEvent], None] = lambda event: None,
        files: WeightFileServer | None = None,
    ) -> None:
        """`files`: the learner's weight-file server, announced so that a worker that cannot see
        `snapshot_dir` catches up over HTTP."""
        super().__init__(name="weight-publisher", daemon=True)
        self.telemetry, self.bus, self.cfg, self.snapshot_dir = telemetry, telemetry.bus, cfg, snapshot_dir
        self.on_sync, self.files = on_sync, files
        self.sender = WeightSender(
            cfg.host,
            cfg.port,
            backend=cfg.backend,
            timeout_s=cfg.timeout_s,
            bucket_bytes=cfg.bucket_mb << 20,
            straggler_s=cfg.straggler_s,
            secret=cfg.secret,
            delta=cfg.delta,
        )
        # A worker that said `stopping` (Ctrl-C, a stop command) will not acknowledge: cut at once, not when
        # its heartbeat expires.
        self.sender.gone = lambda members: set(members) - set(self.telemetry.live_workers())
        self.epoch = 0
        self.members: tuple[str, ...] = ()
        self.needs_new_epoch = True
        self.excluded: dict[str, tuple[float, str]] = {}  # worker → (until when, monotonic; why) left out
        self._excluded_incarnation: dict[str, float | None] = {}  # worker → its started_at when left out
        self._seen_incarnation: dict[str, float | None] = {}  # worker → the started_at it last reported
        self._epoch_incarnation: dict[str, float | None] = {}  # member → its started_at when the epoch formed
        self.last_sync: SyncEvent | None = None  # the newest broadcast every member acknowledged
        self.snapshot_failure: str | None = None  # why the last snapshot could not be written (on the status)
        self._pending: tuple[int, dict[str, torch.Tensor], bool, str | None] | None = None
        self._handed: int | None = None  # the last version handed over for broadcast
        self._wake = threading.Condition()
        self._busy = False
        self._closing = False

    def submit(
        self,
        version: int,
        tensors: dict[str, torch.Tensor],
        broadcast: bool = True,
        adapter_base: str | None = None,
    ) -> None:
        """Hand over a new version (CPU tensors the caller will not modify); replaces any unsent one.
        `broadcast=False` only announces it (and snapshots it): for weights the fleet already holds.
        `adapter_base`: the tensors are a LoRA adapter for the base of that checksum.

        A version is broadcast once: handed over again (a resumed learner's replay ends on the version it
        then starts from), it is not sent a second time. A member that holds the version in the epoch's
        link takes no part in a second broadcast of it, so the learner would wait out `sync.timeout_s` for
        its acknowledgement and then leave it out."""
        with self._wake:
            if broadcast and version == self._handed:
                log.debug("version %d was handed over already: not sent again", version)
                return
            if broadcast:
                self._handed = version
            self._pending = (version, tensors, broadcast, adapter_base)
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
                version, tensors, broadcast, adapter = self._pending
                self._pending, self._busy = None, True
            try:
                self.publish(version, tensors, broadcast, adapter)
            except Exception:  # the learner must outlive any publishing failure; the next version retries
                log.exception("publishing version %d failed", version)
                self.needs_new_epoch = True
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def _exclude(self, worker: str, until: float, why: str, fleet: dict[str, WorkerStatus]) -> None:
        """Leave `worker` out until `until` (monotonic), or until a new incarnation of it heartbeats."""
        self.excluded[worker] = (until, why)
        seen = fleet[worker].started_at if worker in fleet else self._seen_incarnation.get(worker)
        self._excluded_incarnation[worker] = seen

    def choose_members(self) -> tuple[tuple[str, ...], dict[str, str]]:
        """(the members of the next broadcast, why each previous member is not among them)."""
        now = time.monotonic()
        self.excluded = {w: (until, why) for w, (until, why) in self.excluded.items() if until > now}
        fleet = self.telemetry.workers()
        self._seen_incarnation |= {w: s.started_at for w, s in fleet.items()}
        self._new_epoch_for_restarted(fleet)
        for worker in list(self.excluded):
            started, left_out = self._seen_incarnation.get(worker), self._excluded_incarnation.get(worker)
            if started is not None and left_out is not None and started != left_out:
                log.info("%s restarted (a new process under the same id): admitting it again", worker)
                del self.excluded[worker]
        stuck = {
            w
            for w, s in fleet.items()
            if s.progress_at is not None and time.time() - s.progress_at > self.cfg.progress_timeout_s
        }
        for worker in stuck - set(self.excluded):
            log.warning(
                "%s made no progress for over %.0fs: leaving it out", worker, self.cfg.progress_timeout_s
            )
            self._exclude(
                worker, now + self.cfg.timeout_s, "no progress in its loop (hung generation?)", fleet
            )
        members = tuple(w for w, s in fleet.items() if s.state != "stopping" and w not in self.excluded)
        dropped = {}
        for worker in set(self.members) - set(members):
            if worker in self.excluded:
                dropped[worker] = f"left out until it recovers: {self.excluded[worker][1]}"
            elif worker in fleet:
                dropped[worker] = "stopping"
            else:
                dropped[worker] = "heartbeat expired"
        return members, dropped

    def _new_epoch_for_restarted(self, fleet: dict[str, WorkerStatus]) -> None:
        """A member restarted under the same id (a new process since the epoch formed) cannot take part in
        the epoch's link, which its old process held: the next broadcast forms a new epoch, instead of
        sending over that link and waiting out `sync.timeout_s` for both the new and the healthy members."""
        for worker, formed_with in self._epoch_incarnation.items():
            started = fleet[worker].started_at if worker in fleet else formed_with
            if started is not None and formed_with is not None and started != formed_with:
                log.info("%s restarted (a new process under the same id): a new epoch takes it in", worker)
                self.needs_new_epoch = True

    def snapshot(
        self, tensors: dict[str, torch.Tensor], version: int, adapter_base: str | None
    ) -> str | None:
        """The version's snapshot file (for late joiners and workers off this disk); None when it could not
        be written (a full disk): the broadcast goes on without it, and the status says why."""
        try:
            path = str(write_snapshot(tensors, version, self.snapshot_dir, adapter_base))
        except Exception as exc:  # OSError, or safetensors' own error around one (a full disk)
            self.snapshot_failure = failed_write(f"the snapshot of version {version}", self.snapshot_dir, exc)
            log.error("%s; the broadcast goes on without it", self.snapshot_failure)
            return None
        self.snapshot_failure = None
        return path

    def publish(
        self,
        version: int,
        tensors: dict[str, torch.Tensor],
        broadcast: bool = True,
        adapter_base: str | None = None,
    ) -> None:
        snapshot = None
        if version % self.cfg.snapshot_every == 0 or not broadcast:
            snapshot = self.snapshot(tensors, version, adapter_base)
        members, dropped = self.choose_members() if broadcast else ((), {})
        if members != self.members or self.needs_new_epoch:
            self.epoch += 1
            self.members, self.needs_new_epoch = members, False
            self._epoch_incarnation = {w: self._seen_incarnation.get(w) for w in members}
        announcement = self.sender.announce(
            tensors,
            version=version,
            epoch=self.epoch,
            members=list(members),
            snapshot_path=snapshot,
            adapter_base=adapter_base,
        )
        if self.files is not None:
            update = {"files_url": self.files.url, "model_sha256": self.files.model_sha256}
            announcement = announcement.model_copy(update=update)
        if self.cfg.secret is not None:
            announcement = sign_announcement(announcement, self.cfg.secret)
        # Announce first: workers learn of the version (and of the snapshot) before the collective starts.
        self.bus.set_value(ANNOUNCEMENT_KEY, announcement.model_dump_json())
        self.sender.published(announcement)  # what a worker checks a replay in Redis against
        if not broadcast:
            return
        if not members:
            self._record(announcement, "no_members", dropped=dropped)
            return
        try:
            report = self.sender.broadcast(tensors, announcement)
        except SyncFailed as exc:
            self.needs_new_epoch = True
            reason = _drop_reason(exc, self.cfg.timeout_s)
            fleet = self.telemetry.workers()
            for worker in exc.missing:
                self._exclude(worker, time.monotonic() + 2 * self.cfg.timeout_s, reason, fleet)
            cut = exc.phase == "verify" and not exc.reason.startswith("gone")  # the rest had acknowledged
            acknowledged = [m for m in members if m not in exc.missing] if cut else []
            dropped |= {worker: reason for worker in exc.missing}
            self._record(announcement, "failed", dropped, acknowledged, phase=exc.phase, error=str(exc))
            log.warning("broadcast of version %d failed (%s); dropping %s", version, exc, exc.missing or "-")
            return
        event = self._record(
            announcement,
            "ok",
            dropped,
            list(members),
            seconds=report.seconds,
            transfer=report.transfer_seconds,
        )
        self.last_sync = event
        log.info(
            "version %d → %d workers in %.2fs (%.2f GB/s)", version, len(members), report.seconds, report.gbps
        )

    def _record(
        self,
        announcement: WeightAnnouncement,
        outcome: str,
        dropped: dict[str, str],
        acknowledged: list[str] | None = None,
        *,
        phase: str | None = None,
        error: str | None = None,
        seconds: float | None = None,
        transfer: float | None = None,
    ) -> SyncEvent:
        event = SyncEvent(
            version=announcement.version,
            epoch=announcement.group_epoch,
            announced_at=announcement.created_at,
            outcome=outcome,
            phase=phase,
            error=error[:2000] if error else None,
            bytes=announcement.total_bytes,
            buckets=announcement.num_buckets,
            seconds=seconds,
            transfer_seconds=transfer,
            members=list(announcement.members),
            acknowledged=acknowledged or [],
            dropped=dropped,
        )
        try:
            self.on_sync(event)
        except Exception:  # reporting must never stop the broadcasts
            log.exception("recording the sync of version %d failed", announcement.version)
        return event
