"""Surviving a Redis that lost its data (restarted without persistence, flushed): detect it, rebuild.

The learner keeps an *incarnation* value in Redis. A Redis that comes back empty has none: the learner
notices at its next step boundary, re-creates the trained marks from its audit trail
(`RUN_DIR/trained_groups.jsonl`: every group id it ever trained; `filtered_groups.jsonl`: every one it
set aside as uninformative, never to be trained nor made again), then sets a new incarnation. The
feeder (`sparkrl prompts --watch`) waits for that new incarnation and feeds again every prompt whose
group has no trained mark, so what the wipe took from the streams is generated again, and nothing that
was trained is trained twice. With `appendonly yes` none of this is needed: nothing is lost.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

from sparkrl.services.common.bus import RedisBus

log = logging.getLogger("sparkrl.recovery")

INCARNATION_KEY = "incarnation"
TRAINED_PREFIX = "trained:"  # bus value per trained group id: the step that used it


def incarnation(bus: RedisBus) -> str | None:
    raw = bus.get_value(INCARNATION_KEY)
    return raw.decode() if raw is not None else None


def new_incarnation(bus: RedisBus) -> str:
    value = uuid.uuid4().hex
    bus.set_value(INCARNATION_KEY, value)
    return value


def ensure_incarnation(bus: RedisBus) -> str:
    """The bus's incarnation, set now if it has none. The learner and the feeder both call this at
    start, so each knows the same value before either can miss a wipe."""
    bus.set_value(INCARNATION_KEY, uuid.uuid4().hex, only_if_absent=True)
    return incarnation(bus) or ensure_incarnation(bus)


def trained_ids(audit_trail: Path) -> Iterator[tuple[str, int]]:
    """(group id, step) of every group the audit trail says was trained; a torn last line is skipped."""
    if not audit_trail.is_file():
        return
    with audit_trail.open() as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            for group_id in record.get("group_ids", []):
                yield group_id, int(record.get("step", 0))


class WipeWatch:
    """The learner's side: `check()` at each step boundary; True when it just rebuilt after a wipe."""

    bus: RedisBus
    audit_trail: Path
    filtered_trail: Path | None  # groups set aside as uninformative: their marks keep them from being remade
    known: str

    def __init__(self, bus: RedisBus, audit_trail: Path, filtered_trail: Path | None = None) -> None:
        self.bus, self.audit_trail, self.filtered_trail = bus, audit_trail, filtered_trail
        self.known = ensure_incarnation(bus)

    def check(self) -> bool:
        if incarnation(self.bus) == self.known:
            return False
        log.error(
            "Redis at %s lost its data (restarted without persistence?): unread prompts and groups are gone; "
            "rebuilding the trained marks from %s and asking the feeder to feed again",
            self.bus.url,
            self.audit_trail,
        )
        marks = {TRAINED_PREFIX + group_id: str(step) for group_id, step in trained_ids(self.audit_trail)}
        if self.filtered_trail is not None:
            marks |= {
                TRAINED_PREFIX + group_id: "filtered" for group_id, _ in trained_ids(self.filtered_trail)
            }
        self.bus.set_values(marks, ttl_s=self.bus.settings.dedup_ttl_s)
        self.known = new_incarnation(self.bus)  # last: the feeder waits for it, so the marks are in place
        log.info("rebuilt %d trained marks; new incarnation %s", len(marks), self.known)
        return True


def warn_if_not_persistent(bus: RedisBus) -> None:
    """Say loudly, at start, when the bus would lose its streams and marks on a restart."""
    mode = bus.persistence()
    if mode == "aof":
        return
    what = "cannot tell whether it persists anything" if mode is None else f"persists {mode}"
    log.warning(
        "Redis at %s %s: a Redis restart would lose unread prompts and groups and the trained marks. Run it "
        "with `appendonly yes` (sparkrl up's private Redis does)",
        bus.url,
        what,
    )
