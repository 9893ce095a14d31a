"""The ledger: exactly-once, in one place. Every group the bus was told is used is in the model once,
across crashes, restarts and resumes.

A step's groups are acknowledged right after the step, but its update lives only in memory until the
next checkpoint. So `commit` does, in this order:

1. **journal**: the step's raw entries (the encoded groups as they came off the stream) to
   `RUN_DIR/journal/step-NNNNNN.bin`, fsynced: durable before the bus hears they were used;
2. **trained marks**: `trained:<group id>` → the step, in Redis, so that a group delivered again is
   acknowledged instead of trained again (`trained`, which the collector asks before taking a group);
3. **ack**: the entries are acknowledged (and deleted) in the trajectory stream;

and a checkpoint at step C (`checkpointed`) then **trims** the journal up to the checkpoint before C,
B: a resume from C replays the journal's steps after C, in order, as the same steps (`replay`), and
when C does not load, a resume from B replays those after B (checkpoint.restore falls back). Nothing is
acknowledged that is neither in a checkpoint nor in the journal; the journal holds at most two
`learner.checkpoint_every` of steps.

Two more ways the bus and the run can come to disagree, settled here too:

- Redis lost its data (restarted empty): the marks are rebuilt from the audit trail,
  `RUN_DIR/trained_groups.jsonl` and `RUN_DIR/filtered_groups.jsonl` (`rebuild_if_wiped`;
  common/recovery.py).

A group filtered as uninformative (`learner.filter_groups`, dynamic_sampling.py) is never trained, so it
needs neither journal nor checkpoint: `FilteredLog` records it (fsynced), marks it and acknowledges it as
soon as it is read, in that order, so it never holds a place in the trajectory stream.
- The journal was lost with its disk: versions announced past the checkpoint cannot be rebuilt. They are
  retired (`retire_lost_versions`): never produced again (the learner numbers on after them), and a
  group sampled by one of them is refused, since the weights that sampled it no longer exist.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack

from sparkrl.proto import TrajectoryGroup, WeightAnnouncement, decode_group
from sparkrl.services.common.bus import BusError, Entry, RedisBus
from sparkrl.services.common.recovery import TRAINED_PREFIX, WipeWatch, trained_ids
from sparkrl.services.learner.publisher import ANNOUNCEMENT_KEY, SNAPSHOT_NAME
from sparkrl.services.learner.state import TrainState

log = logging.getLogger("sparkrl.learner.ledger")

_NAME = re.compile(r"^step-(\d{6,})\.bin$")
_JOURNAL_MAGIC = b"SPRKJRN2"  # then a u32 header length, the msgpack header, the payloads as they came
AUDIT_TRAIL = "trained_groups.jsonl"  # written with each step row (reporting.RunLog), read after a wipe
FILTERED_TRAIL = "filtered_groups.jsonl"  # the groups set aside as uninformative (FilteredLog)


@dataclass
class Batch:
    """The groups of one step and the stream entries to acknowledge after it."""

    groups: list[TrajectoryGroup]
    entries: list[Entry]
    dropped_stale: int = 0  # stale groups sent back (their prompts fed again) while gathering this batch
    staleness_mean: float = 0.0
    filtered: int = 0  # uninformative groups set aside while gathering it (FilteredLog), not in `groups`


def trained(bus: RedisBus, group_id: str) -> bool:
    """Whether a step already trained on `group_id` (its mark is set): a redelivery, not new data."""
    return bus.get_value(TRAINED_PREFIX + group_id) is not None


def trained_among(bus: RedisBus, group_ids: list[str]) -> set[str]:
    """The ids of `group_ids` a step already trained on, in one round trip. The collector asks once per
    read: asked group by group, each lookup waited its turn in Redis behind the fleet's publishes, and
    that wait, not the learner's CPU, capped the groups it took per second (bench/fleet_scale.py)."""
    if not group_ids:
        return set()
    marks = bus.get_values([TRAINED_PREFIX + group_id for group_id in group_ids])
    return {group_id for group_id, mark in zip(group_ids, marks, strict=True) if mark is not None}


class Journal:
    """`RUN_DIR/journal/`: one file per step since the newest checkpoint."""

    directory: Path

    def __init__(self, run_dir: Path) -> None:
        self.directory = run_dir / "journal"
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:06d}.bin"

    def write(self, step: int, entries: list[Entry]) -> None:
        """Record a step's entries durably (temp file, fsync, rename, fsync of the folder). The payloads go
        to the file as they came from the bus, after a small header: never packed again (a step's 93 MB
        were copied into one msgpack buffer before being written)."""
        header = msgpack.packb(
            {
                "step": step,
                "entries": [[e.entry_id, e.item_id, len(e.payload), e.deliveries] for e in entries],
            },
            use_bin_type=True,
        )
        tmp = self.directory / f".step-{step:06d}.{os.getpid()}.tmp"
        with tmp.open("wb") as file:
            file.write(_JOURNAL_MAGIC + len(header).to_bytes(4, "little") + header)
            for entry in entries:
                file.write(entry.payload)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, self.path(step))
        _fsync_dir(self.directory)

    def steps(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := _NAME.match(p.name)))

    def read(self, step: int) -> list[Entry]:
        data = self.path(step).read_bytes()
        if not data.startswith(_JOURNAL_MAGIC):  # written before the raw layout: one msgpack map
            record = msgpack.unpackb(data, raw=False)
            rows = [(r["entry_id"], r["item_id"], r["payload"], r["deliveries"]) for r in record["entries"]]
        else:
            start = len(_JOURNAL_MAGIC) + 4
            end = start + int.from_bytes(data[len(_JOURNAL_MAGIC) : start], "little")
            record = msgpack.unpackb(data[start:end], raw=False)
            rows, offset = [], end
            for entry_id, item_id, size, deliveries in record["entries"]:
                rows.append((entry_id, item_id, data[offset : offset + size], deliveries))
                offset += size
            if offset != len(data):
                raise ValueError(f"{self.path(step)}: its entries take {offset} bytes, the file {len(data)}")
        if record.get("step") != step:
            raise ValueError(f"{self.path(step)} holds step {record.get('step')}, not {step}")
        return [Entry(*row) for row in rows]

    def replayable(self, after: int) -> list[int]:
        """Steps after `after` that follow it without a gap (a gap ends the replay, loudly)."""
        steps, expected = [], after + 1
        for step in (s for s in self.steps() if s > after):
            if step != expected:
                log.error(
                    "journal gap: step %d follows %d; replaying up to %d only",
                    step,
                    expected - 1,
                    expected - 1,
                )
                break
            steps.append(step)
            expected += 1
        return steps

    def trim(self, upto: int | None = None) -> int:
        """Delete the files of steps ≤ `upto` (None: all); returns how many."""
        removed = 0
        for step in self.steps():
            if upto is None or step <= upto:
                self.path(step).unlink(missing_ok=True)
                removed += 1
        return removed


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the folder's entry is on disk too.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Ledger:
    """The journal, the trained marks and the acknowledgements of one learner, in their order."""

    bus: RedisBus
    journal: Journal
    wipes: WipeWatch
    saved_step: int  # the newest checkpoint's step: the journal holds every step after it

    def __init__(self, bus: RedisBus, run_dir: Path, saved_step: int, fresh: bool) -> None:
        """`saved_step`: the step of the checkpoint the learner started from (0: none). `fresh`: a new
        run, which must not replay an earlier run's journal in the same directory."""
        self.bus, self.journal, self.saved_step = bus, Journal(run_dir), saved_step
        self.wipes = WipeWatch(bus, run_dir / AUDIT_TRAIL, run_dir / FILTERED_TRAIL)
        if fresh and self.journal.trim():
            log.warning(
                "a fresh run in %s: deleted an earlier run's journal (use --resume to go on with it)", run_dir
            )

    def replay(self, after: int) -> Iterator[tuple[int, Batch]]:
        """The journaled steps after `after` (the checkpoint's), in order, each as its batch: their groups
        were acknowledged, so only training them again makes the resumed model reflect them."""
        for step in self.journal.replayable(after):
            entries = self.journal.read(step)
            yield step, Batch([decode_group(e.payload) for e in entries], entries)

    def commit(self, state: TrainState, batch: Batch, journaled: bool = False) -> int:
        """The next step, `state.step + 1`, trained `batch`: journal it, mark its groups trained,
        acknowledge its entries (in that order), and only then count it in `state` (its step, its
        version, its groups). `journaled`: a replay, in the journal already. Returns how many entries
        were acknowledged.

        Commit before count: a step exists only once this returned. When it raises (a disk that cannot
        take the journal, a Redis that refused the marks past `bus.reconnect_max_s`), `state` is as it
        was, so no checkpoint, status or row can claim the step; the weights hold its update all the same,
        and the caller must not checkpoint them (`Learner.uncommitted`)."""
        step = state.step + 1
        if not journaled:
            self.journal.write(step, batch.entries)  # durable before the bus hears it was used
        acked = self.mark_and_ack(step, batch.groups, batch.entries)
        state.step, state.policy_version = step, state.policy_version + 1
        state.groups_trained += len(batch.groups)
        state.groups_filtered += batch.filtered
        state.groups_dropped_stale += batch.dropped_stale
        state.trained_group_ids = [g.group_id for g in batch.groups]
        return acked

    def mark_and_ack(self, step: int, groups: list[TrajectoryGroup], entries: list[Entry]) -> int:
        """Mark `groups` trained by `step` (one round trip), then acknowledge `entries`; how many were
        still pending. Both are idempotent: a repeat after a crash changes nothing."""
        marks = {TRAINED_PREFIX + group.group_id: str(step) for group in groups}
        self.bus.set_values(marks, ttl_s=self.bus.settings.dedup_ttl_s)
        return self.bus.ack("trajectories", [e.entry_id for e in entries])

    def settle_checkpointed(self) -> int:
        """On resume: the journaled steps the checkpoint holds already (≤ `saved_step`) are marked and
        acknowledged again from the journal. A learner whose commit of such a step did not finish (before
        commit-before-count, a failed commit was checkpointed anyway) left its groups pending: delivered
        again, they would be trained twice. Returns how many entries were still pending."""
        pending = 0
        for step in (s for s in self.journal.steps() if s <= self.saved_step):
            entries = self.journal.read(step)
            settled = self.mark_and_ack(step, [decode_group(e.payload) for e in entries], entries)
            if settled:
                log.warning(
                    "step %d is in the checkpoint but %d of its groups were still pending in the stream "
                    "(its commit did not finish): marked trained and acknowledged from the journal",
                    step,
                    settled,
                )
            pending += settled
        return pending

    def checkpointed(self, step: int) -> None:
        """A checkpoint of step `step` was written: it holds those steps now; the journal keeps the steps
        since the checkpoint before it, so that a resume can fall back to that one if this one does not
        load (a full disk, a corrupt file), and trims what is older."""
        if step > self.saved_step:
            self.journal.trim(self.saved_step)
        self.saved_step = step

    def rebuild_if_wiped(self) -> bool:
        """A Redis that lost its data gets the trained marks back from the audit trail (before the next
        group's mark is looked up); True when it had."""
        return self.wipes.check()

    def retire_lost_versions(self, state: TrainState, snapshot_dir: Path) -> None:
        """Versions this run announced past `state`'s and could not rebuild are retired for good."""
        retire_lost_versions(state, last_announced_version(self.bus, snapshot_dir))


class FilteredLog:
    """`RUN_DIR/filtered_groups.jsonl`: the groups set aside as uninformative (`learner.filter_groups`),
    one line per read (`{"version", "group_ids"}`). Such a group is used the moment it is read: recorded
    (fsynced), marked (a redelivery is acknowledged as a replay) and acknowledged, in that order, so a crash
    at any point leaves it recorded once or redelivered, never lost, and it never waits in the trajectory
    stream for a step (held there, a fleet's worth of them would fill it and stop the workers)."""

    bus: RedisBus
    path: Path
    ids: set[str]  # every group id the file records: the count of filtered prompts survives restarts

    def __init__(self, bus: RedisBus, run_dir: Path) -> None:
        self.bus, self.path = bus, run_dir / FILTERED_TRAIL
        self.ids = {group_id for group_id, _ in trained_ids(self.path)}

    def set_aside(self, groups: list[TrajectoryGroup], entries: list[Entry], version: int) -> int:
        """Record `groups` as filtered at learner version `version`; returns the entries acknowledged."""
        ids = [g.group_id for g in groups]
        with self.path.open("a") as file:
            file.write(json.dumps({"version": version, "group_ids": ids}) + "\n")
            file.flush()
            os.fsync(file.fileno())  # recorded before the bus hears the groups were used
        self.bus.set_values(
            {TRAINED_PREFIX + gid: "filtered" for gid in ids}, ttl_s=self.bus.settings.dedup_ttl_s
        )
        self.ids.update(ids)
        return self.bus.ack("trajectories", [e.entry_id for e in entries])


def last_announced_version(bus: RedisBus, snapshot_dir: Path) -> int | None:
    """The highest version this run ever announced: the bus's announcement or the snapshot's."""
    versions = []
    try:
        raw = bus.get_value(ANNOUNCEMENT_KEY)
        if raw is not None:
            versions.append(WeightAnnouncement.model_validate_json(raw).version)
    except (BusError, ValueError) as exc:
        log.warning("cannot read the last weight announcement: %s", exc)
    snapshot = snapshot_dir / SNAPSHOT_NAME
    if snapshot.is_file():
        from safetensors import safe_open

        with safe_open(str(snapshot), framework="pt") as file:
            version = (file.metadata() or {}).get("version")
        if version is not None:
            versions.append(int(version))
    return max(versions, default=None)


def retire_lost_versions(state: TrainState, announced: int | None) -> None:
    """If versions past the state's were announced (and the journal could not rebuild them), retire
    them: recorded in `state.void_versions`, and the next version numbered after them."""
    if announced is None or announced <= state.policy_version:
        return
    lost = [state.policy_version + 1, announced]
    log.error(
        "versions %d..%d were announced but are in neither the checkpoint nor the journal: they are retired "
        "(groups they sampled are refused) and the next version is %d",
        lost[0],
        lost[1],
        announced + 1,
    )
    state.void_versions.append(lost)
    # The weights in hand go out under a number no retired group carries (under `announced` itself, the
    # groups sampled with them would be refused as retired).
    state.policy_version = announced + 1
