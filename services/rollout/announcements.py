"""What a worker follows: the learner's weight announcement, only when it is the learner's.

An announcement tells a worker where to connect (the learner's store), what to load (a snapshot file)
and what to expect (the checksum). Anyone who can write to Redis could forge one, so with a shared
secret (`sync.secret`) the learner signs each and a worker refuses any whose signature does not
verify; and whatever signs it, a snapshot is only loaded from disk when it lies in this worker's run
directory's `snapshots/` (elsewhere — the learner's disk, seen from a container — it comes over HTTP).
"""

from __future__ import annotations

import logging
from pathlib import Path

from sparkrl.proto import WeightAnnouncement, announcement_verifies
from sparkrl.services.common.bus import RedisBus

log = logging.getLogger("sparkrl.rollout")

ANNOUNCEMENT_KEY = "weights"  # where the learner announces each new policy (WeightAnnouncement JSON)


class AnnouncementGate:
    """`latest()`: the newest announcement this worker may follow, or None. One thread uses it."""

    bus: RedisBus
    secret: str | None
    snapshots: Path
    _refused: str | None  # the last announcement refused, so a refusal is logged once, not per poll

    def __init__(self, bus: RedisBus, secret: str | None, run_dir: Path) -> None:
        self.bus, self.secret, self.snapshots = bus, secret, (run_dir / "snapshots").resolve()
        self._refused = None
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
        return announcement

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
