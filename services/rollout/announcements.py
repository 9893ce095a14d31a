"""What a worker follows: the learner's weight announcement, only when it is the learner's.

An announcement tells a worker where to connect (the learner's store), what to load (a snapshot file)
and what to expect (the checksum). Anyone who can write to Redis could forge one, so with a shared
secret (`sync.secret`) the learner signs each and a worker refuses any whose signature does not
verify; and whatever signs it, a snapshot is only loaded from disk when it lies in this worker's run
directory's `snapshots/` (elsewhere — the learner's disk, seen from a container — it comes over HTTP).

A genuine announcement written back later (a replay) verifies too, so each carries the learner's
incarnation and a sequence number inside what is signed: a worker follows only announcements at least
as fresh as the newest it has seen — a newer incarnation (a restarted learner, even one resumed to an
older version), or the same one with a sequence number not below it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sparkrl.proto import WeightAnnouncement, announcement_verifies
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.weight_sync import ANNOUNCEMENT_KEY

log = logging.getLogger("sparkrl.rollout")

__all__ = ["ANNOUNCEMENT_KEY", "AnnouncementGate"]


class AnnouncementGate:
    """`latest()`: the newest announcement this worker may follow, or None. One thread uses it."""

    bus: RedisBus
    secret: str | None
    snapshots: Path
    _refused: str | None  # the last announcement refused, so a refusal is logged once, not per poll
    newest: tuple[int, int, int] | None  # (incarnation, sequence, version) of the newest one seen

    def __init__(self, bus: RedisBus, secret: str | None, run_dir: Path) -> None:
        self.bus, self.secret, self.snapshots = bus, secret, (run_dir / "snapshots").resolve()
        self._refused = None
        self.newest = None
        if secret is None:
            log.warning("sync.secret is not set: weight announcements are not authenticated")

    def latest(self) -> WeightAnnouncement | None:
        raw = self.bus.get_value(ANNOUNCEMENT_KEY)
        if raw is None:
            return None
        try:
            announcement = WeightAnnouncement.model_validate_json(raw)
        except ValueError as exc:
            return self._refuse(raw, f"malformed: {exc}")
        if self.secret is not None and not announcement_verifies(announcement, self.secret):
            return self._refuse(raw, "its signature does not verify (forged, or sync.secret differs)")
        stale = self._older_than_seen(announcement)
        if stale is not None:
            return self._refuse(raw, stale)
        self.newest = (announcement.incarnation, announcement.sequence, announcement.version)
        return announcement

    def _older_than_seen(self, announcement: WeightAnnouncement) -> str | None:
        """Why `announcement` is older than the newest this worker has seen (a replay), or None."""
        if self.newest is None:
            return None
        incarnation, sequence, version = self.newest
        if announcement.incarnation < incarnation:
            return (
                f"version {announcement.version} comes from an earlier learner incarnation than version "
                f"{version}, which this worker has seen: a replayed announcement"
            )
        if announcement.incarnation == incarnation and announcement.sequence < sequence:
            return (
                f"version {announcement.version} (announcement {announcement.sequence}) is older than "
                f"version {version} (announcement {sequence}) of the same learner: a replayed announcement"
            )
        return None

    def local_snapshot(self, announcement: WeightAnnouncement) -> Path | None:
        """The announced snapshot as a file to load, only when it lies in our run directory's snapshots/
        and is there (a worker in a container does not see the learner's disk)."""
        if announcement.snapshot_path is None:
            return None
        path = Path(announcement.snapshot_path).resolve()
        return path if path.is_relative_to(self.snapshots) and path.is_file() else None

    def _refuse(self, raw: bytes, why: str) -> None:
        key = raw.decode(errors="replace")
        if key != self._refused:
            self._refused = key
            log.error("refusing a weight announcement: %s", why)
        return None
