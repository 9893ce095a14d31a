"""The learner's batch collector on a real redis-server: a burst of groups near the end of their reach
is trained, not dropped; read-ahead is bounded; what is past reach is sent back (its prompt fed again, to
be made anew: finite data is not lost) and counted."""

from __future__ import annotations

import time

import numpy as np

from sparkrl.proto import Prompt, TrajectoryGroup, decode_message, encode_group
from sparkrl.proto.testing import random_group
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import BusSettings, LearnerSettings
from sparkrl.services.learner.collect import BatchCollector
from sparkrl.services.learner.validate import ModelLimits

LIMITS = ModelLimits(vocab_size=260, max_len=None, needs_topk=True)


def sampled_by(seed: int, version: int) -> TrajectoryGroup:
    g = random_group(np.random.default_rng(seed), n=2, T=4, k=4, vocab_size=260, max_new_tokens=8)
    completions = [
        c.model_copy(update={"policy_versions": np.full_like(c.policy_versions, version)})
        for c in g.completions
    ]
    return g.model_copy(update={"completions": completions})


STALENESS = 2  # learner.max_staleness in force: what the loop hands the collector at each read


def collector(bus: RedisBus, batch: str = "grow") -> BatchCollector:
    return BatchCollector(bus, LearnerSettings(prompts_per_step=4, batch=batch), LIMITS)


def test_a_burst_at_the_edge_of_reach_joins_the_step(bus_settings: BusSettings) -> None:
    with RedisBus(bus_settings.model_copy(update={"trajectory_maxlen": 64})) as bus:
        old = [sampled_by(i, 0) for i in range(10)]  # would be too stale after a step at version 2
        new = [sampled_by(100 + i, 2) for i in range(6)]
        for g in new[:2] + old + new[2:]:
            assert bus.publish_group(g.group_id, encode_group(g))
        c = collector(bus)
        assert c.reach(STALENESS) == 12  # (max_staleness + 1) steps of 4
        batch = c.fill(2, STALENESS, lambda: False)
        assert batch is not None and batch.dropped_stale == 0
        # The 10 old groups all go now (4 + 6 that could not wait), oldest first; read-ahead stopped at 12.
        assert {g.group_id for g in batch.groups} == {g.group_id for g in old}
        assert [g.group_id for g in c.groups] == [g.group_id for g in new[:2]]
        assert bus.pending_info("trajectories").lag == 4  # the rest wait in the stream
        nxt = c.fill(3, STALENESS, lambda: False)
        assert nxt is not None and {g.group_id for g in nxt.groups} == {g.group_id for g in new[:4]}


def test_a_fixed_batch_is_prompts_per_step_groups_and_the_rest_is_made_again(
    bus_settings: BusSettings,
) -> None:
    """(issue 36, item 5) learner.batch fixed: the burst of the test above gives steps of exactly 4
    groups; the old groups that cannot wait for a later step are sent back, not trained in a bigger step."""
    with RedisBus(bus_settings.model_copy(update={"trajectory_maxlen": 64})) as bus:
        old = [sampled_by(i, 0) for i in range(10)]
        new = [sampled_by(100 + i, 2) for i in range(6)]
        for g in new[:2] + old + new[2:]:
            assert bus.publish_prompt(g.prompt.prompt_id, b"as fed")
            assert bus.publish_group(g.group_id, encode_group(g))
        bus.ack("prompts", [e.entry_id for e in bus.read("prompts", "worker", 16)])  # sampled, published
        c = collector(bus, batch="fixed")
        batch = c.fill(2, STALENESS, lambda: False)
        assert batch is not None and len(batch.groups) == 4  # the 4 oldest
        assert {g.group_id for g in batch.groups} <= {g.group_id for g in old}
        nxt = c.fill(3, STALENESS, lambda: False)  # at version 3 the other 6 old ones are past reach
        assert nxt is not None and len(nxt.groups) == 4 and nxt.dropped_stale == 6
        assert {g.group_id for g in nxt.groups} == {g.group_id for g in new[:4]}
        assert bus.pending_info("prompts").lag == 6  # their prompts are fed again, to be made anew


def test_groups_past_reach_are_sent_back_to_be_made_again(bus_settings: BusSettings) -> None:
    with RedisBus(bus_settings) as bus:
        groups = [sampled_by(i, 0) for i in range(3)] + [sampled_by(10 + i, 5) for i in range(4)]
        for g in groups:
            assert bus.publish_prompt(g.prompt.prompt_id, b"as fed")  # the feeder's dedup marks
            assert bus.publish_group(g.group_id, encode_group(g))
        bus.ack("prompts", [e.entry_id for e in bus.read("prompts", "worker", 7)])  # sampled, published
        batch = collector(bus).fill(5, STALENESS, lambda: False)
        assert batch is not None and batch.dropped_stale == 3
        assert {g.group_id for g in batch.groups} == {g.group_id for g in groups[3:]}
        assert bus.pending_info("trajectories").pending == 4  # the stale ones are acked, not pending
        # Their prompts are back in the feed, as they were delivered (same ids: the same group ids) ...
        back = bus.read("prompts", "worker", 10)
        assert [decode_message(e.payload, Prompt) for e in back] == [g.prompt for g in reversed(groups[:3])]
        # ... and the groups made again are accepted, though their ids were published before.
        assert all(bus.publish_group(g.group_id, encode_group(g)) for g in groups[:3])
        assert not bus.publish_prompt(groups[0].prompt.prompt_id, b"fed again")  # the feeder's dedup holds
        bus.ack("trajectories", [e.entry_id for e in batch.entries])  # trained
        assert not bus.send_back(batch.entries[0], "p", b"")  # no longer pending: nothing is sent back
        assert bus.pending_info("prompts").lag == 0


def test_a_group_made_again_is_judged_by_its_own_versions(bus_settings: BusSettings) -> None:
    """The collector works a held group's oldest version out once (the stale check looks at every held
    group on every read); a group sent back stale and made again under the same id (its prompt's) by
    newer weights is judged by the new copy, not by what was worked out for the old one."""
    with RedisBus(bus_settings) as bus:
        old = sampled_by(0, 0)
        assert bus.publish_prompt(old.prompt.prompt_id, b"as fed")
        assert bus.publish_group(old.group_id, encode_group(old))
        bus.ack("prompts", [e.entry_id for e in bus.read("prompts", "worker", 1)])
        c = collector(bus)
        c.read_ahead(0, STALENESS)
        assert [g.group_id for g in c.groups] == [old.group_id] and c.oldest == {old.group_id: 0}
        c.read_ahead(3, STALENESS)  # version 3: 3 versions behind, past max_staleness 2
        assert c.groups == [] and c.oldest == {}
        assert bus.pending_info("prompts").lag == 1  # fed again
        again = old.model_copy(
            update={
                "completions": [
                    done.model_copy(update={"policy_versions": np.full_like(done.policy_versions, 3)})
                    for done in old.completions
                ]
            }
        )
        assert again.group_id == old.group_id
        assert bus.publish_group(again.group_id, encode_group(again))
        c.read_ahead(3, STALENESS)
        assert [g.group_id for g in c.groups] == [old.group_id] and c.oldest == {old.group_id: 3}
        assert c.dropped == 1  # the first copy only


def test_read_ahead_on_a_thread_holds_a_step_and_leaves_it_pending_for_the_next_learner(
    bus_settings: BusSettings,
) -> None:
    """Issue 50 item 2 (`learner.read_ahead_mb`): while a step trains, a thread reads the next step's
    groups (at most a step's worth, within the byte budget), decoded and validated; they stay pending in
    Redis, so a learner that stops (or crashes) with them in hand leaves them to the next one, which
    trains each once."""
    settings = bus_settings.model_copy(update={"trajectory_maxlen": 64, "claim_idle_ms": 500})
    groups = [sampled_by(i, 0) for i in range(10)]
    with RedisBus(settings) as bus:
        for g in groups:
            assert bus.publish_group(g.group_id, encode_group(g))
        c = collector(bus)
        c.start_read_ahead()
        try:
            first = c.fill(0, STALENESS, lambda: False)
            assert first is not None and len(first.groups) >= 4
            # The step "trains": the thread takes the next step's groups, a step's worth and no more.
            deadline = time.monotonic() + 10
            while len(c.prefetch.queue) < 4 and time.monotonic() < deadline:  # type: ignore[union-attr]
                time.sleep(0.05)
            ahead = [g.group_id for _, g in c.prefetch.queue]  # type: ignore[union-attr]
            assert len(ahead) == 4 and not set(ahead) & {g.group_id for g in first.groups}
            time.sleep(1.0)  # past claim_idle_ms: the thread keeps its entries alive meanwhile
            bus.ack("trajectories", [e.entry_id for e in first.entries])  # the step committed
        finally:
            c.stop_read_ahead()  # a learner that stops here holds groups read ahead, never acknowledged
        held = {g.group_id for g in c.groups} | set(ahead)
        assert bus.pending_info("trajectories").pending == len(held)
    time.sleep(0.6)  # the next learner finds them idle and takes them
    with RedisBus(settings) as bus:
        again, trained = collector(bus), []
        stop_at = time.monotonic() + 5
        while len(trained) < len(held) and time.monotonic() < stop_at:
            batch = again.fill(0, STALENESS, lambda: time.monotonic() > stop_at)
            if batch is not None:  # the step commits: acknowledged, never delivered again
                trained += [g.group_id for g in batch.groups]
                bus.ack("trajectories", [e.entry_id for e in batch.entries])
        trained += [g.group_id for g in again.groups]  # the last, partial step's
        assert held <= set(trained) and len(trained) == len(set(trained))  # the held ones, each once
        # with the first step's and the ones never read, every group exactly once, none lost
        assert sorted([g.group_id for g in first.groups] + trained) == sorted(g.group_id for g in groups)


def test_read_ahead_never_reclaims_what_the_loop_holds_or_trains(bus_settings: BusSettings) -> None:
    """A read reclaims the consumer's idle entries (a dead learner's). The thread reads while a step
    trains, longer than `bus.claim_idle_ms`: the groups the loop holds and the batch it trains are kept
    alive, never delivered again (a group delivered past `bus.max_deliveries` is dead-lettered)."""
    settings = bus_settings.model_copy(update={"trajectory_maxlen": 64, "claim_idle_ms": 300})
    with RedisBus(settings) as bus:
        for g in [sampled_by(i, 0) for i in range(4)]:
            assert bus.publish_group(g.group_id, encode_group(g))
        c = collector(bus)
        c.start_read_ahead()
        try:
            batch = c.fill(0, STALENESS, lambda: False)  # a step's 4
            assert batch is not None
            for i in range(3):  # a 1.5 s step: the thread reads what comes meanwhile, with room to spare
                time.sleep(0.5)
                g = sampled_by(100 + i, 0)
                assert bus.publish_group(g.group_id, encode_group(g))
            key, group = bus.stream_key("trajectories"), bus.groups["trajectories"]
            pending = bus._redis.xpending_range(key, group, "-", "+", 100)
            assert pending and all(p["times_delivered"] == 1 for p in pending), pending
            assert bus.dead_letters() == []
        finally:
            c.stop_read_ahead()
