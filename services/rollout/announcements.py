"""What a worker follows: the learner's weight announcement, only when it is the learner's, and current.

An announcement tells a worker where to connect (the learner's store), what to load (a snapshot file)
and what to expect (the checksum). Anyone who can write to Redis could forge one, so with a shared
secret (`sync.secret`) the learner signs each and a worker refuses any whose signature does not
verify; and whatever signs it, a snapshot is only loaded from disk when it lies in this worker's run
directory's `snapshots/` (elsewhere — the learner's disk, seen from a container — it comes over HTTP).

A genuine announcement written back later (a replay) verifies too, so each carries the learner's
incarnation and a sequence number inside what is signed: a worker follows only announcements at least
as fresh as the newest it has seen — a newer incarnation (a restarted learner, even one resumed to an
older version), or the same one with a sequence number not below it. A worker that has seen nothing of a
learner yet (it just started, or the learner did) has no newest to compare with, so it asks the learner's
own store what is current (`sender.published` records it there after each Redis write) and refuses an
announcement older than that, or one of a learner whose store now serves another: Redis alone cannot
say, since whoever writes the replay can write any key beside it. That record is sealed with the secret
(`weight_sync/sealed_store.py`): one that does not verify is a refusal, retried, never a pass. When no
store answers, the learner is gone and there is no epoch to join: the announcement is followed (only its
snapshot can be loaded), with a warning.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import NamedTuple

from sparkrl.proto import WeightAnnouncement, announcement_verifies
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.weight_sync import ANNOUNCEMENT_KEY
from sparkrl.services.common.weight_sync.rendezvous import ask_current
from sparkrl.services.common.weight_sync.sealed_store import ForgedValue

log = logging.getLogger("sparkrl.rollout")

__all__ = ["ANNOUNCEMENT_KEY", "AnnouncementGate"]

STORE_ASK_S = 3.0  # asking a learner's store what is current (it answers in milliseconds when it is up)
NOT_RECORDED_RETRY_S = 0.1  # read between the learner's Redis write and its store record: look again soon
FORGED_RETRY_S = 1.0  # the store's current record does not verify: the learner's next write replaces it


class Refusal(NamedTuple):
    why: str
    retry_s: float = math.inf  # the same announcement is looked at again after this; inf: never (final)
    level: int = logging.ERROR


class AnnouncementGate:
    """`latest()`: the newest announcement this worker may follow, or None. One thread uses it."""

    bus: RedisBus
    secret: str | None
    snapshots: Path
    store_timeout_s: float
    _refused: bytes | None  # the last announcement refused: not looked at again before `_retry_at`
    _retry_at: float  # monotonic; inf: never (the same bytes cannot turn valid or fresh)
    _said: str | None  # the last refusal logged: each is said once, not on every poll
    newest: tuple[int, int, int] | None  # (incarnation, sequence, version) of the newest one seen

    def __init__(
        self, bus: RedisBus, secret: str | None, run_dir: Path, store_timeout_s: float = STORE_ASK_S
    ) -> None:
        self.bus, self.secret, self.snapshots = bus, secret, (run_dir / "snapshots").resolve()
        self.store_timeout_s = store_timeout_s
        self._refused, self._retry_at, self._said = None, 0.0, None
        self.newest = None
        if secret is None:
            log.warning("sync.secret is not set: weight announcements are not authenticated")

    def latest(self) -> WeightAnnouncement | None:
        raw = self.bus.get_value(ANNOUNCEMENT_KEY)
        if raw is None or (raw == self._refused and time.monotonic() < self._retry_at):
            return None
        try:
            announcement = WeightAnnouncement.model_validate_json(raw)
        except ValueError as exc:
            return self._refuse(raw, Refusal(f"malformed: {exc}"))
        if self.secret is not None and not announcement_verifies(announcement, self.secret):
            forged = "its signature does not verify (forged, or sync.secret differs)"
            return self._refuse(raw, Refusal(forged))
        stale = self._older_than_seen(announcement)
        if stale is not None:
            return self._refuse(raw, Refusal(stale))
        if self.newest is None or announcement.incarnation > self.newest[0]:
            refusal = self._not_current(announcement)
            if refusal is not None:
                if self.bus.get_value(ANNOUNCEMENT_KEY) != raw:
                    return None  # superseded while the store was asked, not replayed: the next look takes it
                return self._refuse(raw, refusal)
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

    def _not_current(self, announcement: WeightAnnouncement) -> Refusal | None:
        """Why an announcement of a learner this worker has seen nothing of is not that learner's current
        one, as its own store says; None when it is."""
        host, port = announcement.rendezvous_host, announcement.rendezvous_port
        try:
            current = ask_current(host, port, self.store_timeout_s, self.secret)
        except ForgedValue:
            # Not "unchecked": a record written without the secret must not open the door to a replay.
            why = f"the current record in its learner's store at {host}:{port} does not verify (forged?)"
            return Refusal(why, FORGED_RETRY_S, logging.WARNING)
        except (OSError, RuntimeError) as exc:
            # A learner that is gone (its run ended; a fleet under compose outlives it) leaves no epoch to
            # join: following its announcement only loads a snapshot (from our run directory, or verified
            # over HTTP), which a late joiner must still be able to do.
            log.warning(
                "following version %d unchecked: its learner's store at %s:%d does not answer (%s)",
                announcement.version, host, port, exc,
            )  # fmt: skip
            return None
        if current is None:
            return Refusal("its learner has not recorded it yet", NOT_RECORDED_RETRY_S, logging.DEBUG)
        if current.incarnation != announcement.incarnation:
            return Refusal(
                f"version {announcement.version} comes from a learner that is gone (its store at "
                f"{host}:{port} serves another now): a replayed announcement"
            )
        if announcement.sequence < current.sequence:
            return Refusal(
                f"version {announcement.version} (announcement {announcement.sequence}) is older than the "
                f"learner's current announcement {current.sequence}, as its store says: a replayed "
                "announcement"
            )
        return None

    def local_snapshot(self, announcement: WeightAnnouncement) -> Path | None:
        """The announced snapshot as a file to load, only when it lies in our run directory's snapshots/
        and is there (a worker in a container does not see the learner's disk)."""
        if announcement.snapshot_path is None:
            return None
        path = Path(announcement.snapshot_path).resolve()
        return path if path.is_relative_to(self.snapshots) and path.is_file() else None

    def _refuse(self, raw: bytes, refusal: Refusal) -> None:
        if refusal.why != self._said:
            self._said = refusal.why
            log.log(refusal.level, "refusing a weight announcement: %s", refusal.why)
        self._refused, self._retry_at = raw, time.monotonic() + refusal.retry_s
        return None
