"""The learner's ledger (exactly-once: journal → trained marks → ack → checkpoint trim) against a private
redis-server alone: no model, no DeepSpeed. What a crash between any two of its writes leaves is
either replayed from the journal or never acknowledged."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis
import torch

from sparkrl.proto import TrajectoryGroup, decode_group, encode_group
from sparkrl.proto.testing import random_group
from sparkrl.services.common.bus import Entry, RedisBus
from sparkrl.services.common.recovery import TRAINED_PREFIX
from sparkrl.services.common.settings import BusSettings
from sparkrl.services.learner.ledger import AUDIT_TRAIL, Batch, Journal, Ledger, trained
from sparkrl.services.learner.publisher import write_snapshot
from sparkrl.services.learner.state import TrainState


def groups(count: int, seed: int = 0) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(seed)
    return [random_group(rng, n=2, T=3, k=2, vocab_size=260, max_new_tokens=4) for _ in range(count)]


def read_batch(bus: RedisBus, count: int) -> Batch:
    """What the collector hands the loop: decoded groups and their stream entries, still pending."""
    entries = bus.read("trajectories", "learner", count)
    return Batch([decode_group(e.payload) for e in entries], entries)


def published(bus: RedisBus, *made: TrajectoryGroup) -> None:
    for group in made:
        assert bus.publish_group(group.group_id, encode_group(group))


def test_a_step_is_journaled_then_marked_then_acknowledged(bus_settings: BusSettings, tmp_path: Path) -> None:
    with RedisBus(bus_settings) as bus:
        made = groups(3)
        published(bus, *made)
        ledger, state = Ledger(bus, tmp_path, saved_step=0, fresh=True), TrainState()
        batch = read_batch(bus, 3)
        assert not any(trained(bus, g.group_id) for g in made)
        assert ledger.commit(state, batch) == 3
        assert (state.step, state.policy_version) == (1, 1)  # counted once committed
        assert bus.pending_info("trajectories").pending == 0
        assert [bus.get_value(TRAINED_PREFIX + g.group_id) for g in made] == [b"1"] * 3
        assert all(trained(bus, g.group_id) for g in made)
        assert ledger.journal.steps() == [1] and ledger.journal.read(1) == batch.entries
        assert (state.groups_trained, state.trained_group_ids) == (3, [g.group_id for g in made])


def test_a_restart_replays_what_no_checkpoint_holds_and_a_checkpoint_trims_it(
    bus_settings: BusSettings, tmp_path: Path
) -> None:
    with RedisBus(bus_settings) as bus:
        made = groups(4, seed=1)
        published(bus, *made)
        ledger, state = Ledger(bus, tmp_path, saved_step=0, fresh=True), TrainState()
        for _ in range(2):
            ledger.commit(state, read_batch(bus, 2))
        ledger.checkpointed(1)
        # The journal keeps the steps since the checkpoint before this one (none: from the start), so a
        # resume can fall back to it if this one does not load; the next checkpoint trims up to step 1.
        assert ledger.saved_step == 1 and ledger.journal.steps() == [1, 2]

        # A crash, then `--resume` from the checkpoint of step 1: step 2 was acknowledged, so only the
        # journal holds it; it comes back as the same step, the same groups, the same entries.
        again = Ledger(bus, tmp_path, saved_step=1, fresh=False)
        [(step, batch)] = list(again.replay(after=1))
        assert step == 2 and [g.group_id for g in batch.groups] == [g.group_id for g in made[2:]]
        resumed = TrainState(step=1, groups_trained=2)
        assert again.commit(resumed, batch, journaled=True) == 0  # acknowledged before the crash
        assert again.journal.steps() == [1, 2] and (resumed.step, resumed.groups_trained) == (2, 4)
        again.checkpointed(2)
        assert again.journal.steps() == [2]  # trimmed up to the checkpoint before this one
        again.checkpointed(2)  # a tagged checkpoint of the same step trims nothing more
        assert again.journal.steps() == [2] and list(again.replay(after=2)) == []


def test_a_fresh_run_forgets_an_earlier_runs_journal(bus_settings: BusSettings, tmp_path: Path) -> None:
    with RedisBus(bus_settings) as bus:
        Journal(tmp_path).write(7, [Entry("7-0", "g", b"x", 1)])
        assert Ledger(bus, tmp_path, saved_step=0, fresh=False).journal.steps() == [7]  # a resume keeps it
        assert Ledger(bus, tmp_path, saved_step=0, fresh=True).journal.steps() == []


def test_journal_round_trip_gaps_and_trim(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    for step in (5, 6, 7, 9):
        journal.write(step, [Entry(f"{step}-0", f"g{step}", bytes([step]) * 3, 1)])
    assert journal.steps() == [5, 6, 7, 9]
    assert journal.read(6) == [Entry("6-0", "g6", b"\x06\x06\x06", 1)]
    assert journal.replayable(after=4) == [5, 6, 7]  # 8 is missing: the replay stops before the gap
    assert journal.replayable(after=6) == [7]
    assert journal.trim(6) == 2 and journal.steps() == [7, 9]
    assert not list(tmp_path.joinpath("journal").glob(".*.tmp"))  # written by rename, nothing half-done


def test_the_journal_holds_the_payloads_as_they_came_and_still_reads_the_older_layout(tmp_path: Path) -> None:
    """Issue 50 item 2: a step's payloads are written after a small header, never packed again; a journal
    written before (one msgpack map of the records) is still replayed after an upgrade."""
    journal = Journal(tmp_path)
    payloads = [encode_group(random_group(np.random.default_rng(i), n=2, T=16, k=4)) for i in range(3)]
    entries = [Entry(f"1-{i}", f"g{i}", payload, 1 + i) for i, payload in enumerate(payloads)]
    journal.write(1, entries)
    raw = journal.path(1).read_bytes()
    assert raw.startswith(b"SPRKJRN2") and raw.endswith(b"".join(payloads))  # verbatim, in order
    assert journal.read(1) == entries
    older = {"step": 2, "entries": [{"entry_id": e.entry_id, "item_id": e.item_id, "payload": e.payload,
                                      "deliveries": e.deliveries} for e in entries]}  # fmt: skip
    journal.path(2).write_bytes(msgpack.packb(older, use_bin_type=True))
    assert journal.read(2) == entries
    journal.path(3).write_bytes(raw[:-5])  # a file cut short is refused, never half-read
    with pytest.raises(ValueError, match="its entries take"):
        journal.read(3)


def test_a_wiped_redis_gets_the_trained_marks_back_from_the_audit_trail(
    bus_settings: BusSettings, tmp_path: Path
) -> None:
    with RedisBus(bus_settings) as bus:
        made = groups(2, seed=2)
        published(bus, *made)
        ledger = Ledger(bus, tmp_path, saved_step=0, fresh=True)
        ledger.commit(TrainState(), read_batch(bus, 2))
        # The audit trail's record of the step, as the step row's writer appends it.
        record = {"step": 1, "group_ids": [g.group_id for g in made]}
        (tmp_path / AUDIT_TRAIL).write_text(json.dumps(record) + "\n")
        assert not ledger.rebuild_if_wiped()
        redis.Redis.from_url(bus_settings.url).flushdb()
        assert not any(trained(bus, g.group_id) for g in made)
        assert ledger.rebuild_if_wiped()
        assert all(trained(bus, g.group_id) for g in made)


def test_versions_announced_past_the_checkpoint_are_retired(
    bus_settings: BusSettings, tmp_path: Path
) -> None:
    with RedisBus(bus_settings) as bus:
        ledger = Ledger(bus, tmp_path, saved_step=4, fresh=False)
        state = TrainState(step=4, policy_version=4)
        ledger.retire_lost_versions(state, tmp_path / "snapshots")  # nothing announced: nothing retired
        assert (state.policy_version, state.void_versions) == (4, [])
        # The journal was lost: the snapshot says version 9 went out, which the checkpoint cannot rebuild.
        write_snapshot({"w": torch.zeros(2)}, 9, tmp_path / "snapshots")
        ledger.retire_lost_versions(state, tmp_path / "snapshots")
        assert (state.policy_version, state.void_versions) == (10, [[5, 9]])
