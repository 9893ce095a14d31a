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
  `RUN_DIR/trained_groups.jsonl` (`rebuild_if_wiped`; common/recovery.py), filtered groups' included.

A group filtered as uninformative (`learner.filter_groups`, dynamic_sampling.py) goes through all of this
with the step it is committed with, journal included, and is counted apart: never trained.
- The journal was lost with its disk: versions announced past the checkpoint cannot be rebuilt. They are
  retired (`retire_lost_versions`): never produced again (the learner numbers on after them), and a
  group sampled by one of them is refused, since the weights that sampled it no longer exist.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack

from sparkrl.proto import TrajectoryGroup, WeightAnnouncement, decode_group
from sparkrl.services.common.bus import BusError, Entry, RedisBus
from sparkrl.services.common.recovery import TRAINED_PREFIX, WipeWatch
from sparkrl.services.learner.publisher import ANNOUNCEMENT_KEY, SNAPSHOT_NAME
from sparkrl.services.learner.state import TrainState

log = logging.getLogger("sparkrl.learner.ledger")

_NAME = re.compile(r"^step-(\d{6,})\.bin$")
AUDIT_TRAIL = "trained_groups.jsonl"  # written with each step row (reporting.RunLog), read after a wipe


@dataclass
class Batch:
    """The groups of one step and the stream entries to acknowledge after it."""

    groups: list[TrajectoryGroup]
    entries: list[Entry]
    dropped_stale: int = 0  # stale groups sent back (their prompts fed again) while gathering this batch
    staleness_mean: float = 0.0
    # Of `groups`, the ids filtered as uninformative (dynamic_sampling.py): committed, never trained.
    filtered_ids: frozenset[str] = frozenset()

    @property
    def trained_ids(self) -> list[str]:
        """The ids of the groups the step trains (or leaves out of its loss), in order: all but the
        filtered ones."""
        return [g.group_id for g in self.groups if g.group_id not in self.filtered_ids]

    def part(self, indexes: list[int]) -> Batch:
        """The batch of `groups[i]` for i in `indexes` (what an update that was not applied leaves)."""
        groups = [self.groups[i] for i in indexes]
        filtered = self.filtered_ids & {g.group_id for g in groups}
        entries = [self.entries[i] for i in indexes]
        return Batch(groups, entries, self.dropped_stale, self.staleness_mean, filtered)


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

    def write(self, step: int, entries: list[Entry], filtered_ids: frozenset[str] = frozenset()) -> None:
        """Record a step's entries, and which of their groups it filtered, durably (temp file, fsync,
        rename, fsync of the folder)."""
        records = [
            {"entry_id": e.entry_id, "item_id": e.item_id, "payload": e.payload, "deliveries": e.deliveries}
            for e in entries
        ]
        step_record = {"step": step, "entries": records, "filtered": sorted(filtered_ids)}
        data = msgpack.packb(step_record, use_bin_type=True)
        tmp = self.directory / f".step-{step:06d}.{os.getpid()}.tmp"
        with tmp.open("wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, self.path(step))
        _fsync_dir(self.directory)

    def steps(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := _NAME.match(p.name)))

    def read(self, step: int) -> list[Entry]:
        return self.read_step(step)[0]

    def read_step(self, step: int) -> tuple[list[Entry], frozenset[str]]:
        """A step's entries and the ids of the groups it filtered (none in a journal written before)."""
        record = msgpack.unpackb(self.path(step).read_bytes(), raw=False)
        if record.get("step") != step:
            raise ValueError(f"{self.path(step)} holds step {record.get('step')}, not {step}")
        rows = record["entries"]
        entries = [Entry(r["entry_id"], r["item_id"], r["payload"], r["deliveries"]) for r in rows]
        return entries, frozenset(record.get("filtered", ()))

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
        self.wipes = WipeWatch(bus, run_dir / AUDIT_TRAIL)
        if fresh and self.journal.trim():
            log.warning(
                "a fresh run in %s: deleted an earlier run's journal (use --resume to go on with it)", run_dir
            )

    def replay(self, after: int) -> Iterator[tuple[int, Batch]]:
        """The journaled steps after `after` (the checkpoint's), in order, each as its batch: their groups
        were acknowledged, so only training them again makes the resumed model reflect them."""
        for step in self.journal.replayable(after):
            entries, filtered = self.journal.read_step(step)
            yield step, Batch([decode_group(e.payload) for e in entries], entries, filtered_ids=filtered)

    def commit(self, state: TrainState, batch: Batch, journaled: bool = False) -> int:
        """Step `state.step` trained `batch`: journal it, mark its groups trained, acknowledge its
        entries (in that order), and count it in `state`. `journaled`: a replay, in the journal already.
        Returns how many entries were acknowledged."""
        if not journaled:  # durable before the bus hears it was used
            self.journal.write(state.step, batch.entries, batch.filtered_ids)
        # A filtered group is marked too: it was used (never to be trained), so a redelivery is acknowledged.
        marks = {TRAINED_PREFIX + group.group_id: str(state.step) for group in batch.groups}
        self.bus.set_values(marks, ttl_s=self.bus.settings.dedup_ttl_s)  # one round trip for the step
        acked = self.bus.ack("trajectories", [e.entry_id for e in batch.entries])
        state.trained_group_ids = batch.trained_ids
        state.filtered_group_ids = sorted(batch.filtered_ids)
        state.groups_trained += len(state.trained_group_ids)
        state.groups_filtered += len(batch.filtered_ids)
        state.groups_dropped_stale += batch.dropped_stale
        return acked

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
