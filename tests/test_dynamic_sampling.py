"""Dynamic sampling (`learner.filter_groups`, services/learner/dynamic_sampling.py) by hand: the filter on
groups of equal and unequal rewards; on a real redis-server, a batch filled with informative groups while
the uninformative ones are set aside as they are read (recorded, marked, acknowledged: never held, never
sent back); the record surviving a restart and a Redis wipe; the data's end with filtered groups alone;
the refusal of lockstep."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from sparkrl.proto import TrajectoryGroup, encode_group
from sparkrl.proto.testing import random_group
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.feeder import FeedReport, mark_fed
from sparkrl.services.common.recovery import TRAINED_PREFIX, WipeWatch, new_incarnation
from sparkrl.services.common.settings import BusSettings, LearnerSettings, load_settings
from sparkrl.services.learner.collect import BatchCollector
from sparkrl.services.learner.dynamic_sampling import equal_rewards, filtered, out_of_loss
from sparkrl.services.learner.ledger import FILTERED_TRAIL, FilteredLog, Ledger
from sparkrl.services.learner.state import TrainState
from sparkrl.services.learner.validate import ModelLimits

LIMITS = ModelLimits(vocab_size=260, max_len=None, needs_topk=True)
ON = LearnerSettings(prompts_per_step=2, filter_groups="zero_variance")


def scored(seed: int, rewards: list[float], version: int = 0) -> TrajectoryGroup:
    g = random_group(np.random.default_rng(seed), n=len(rewards), T=3, k=4, vocab_size=260, max_new_tokens=8)
    completions = [
        c.model_copy(update={"policy_versions": np.full_like(c.policy_versions, version)})
        for c in g.completions
    ]
    details = [d.model_copy(update={"score": r}) for d, r in zip(g.reward_details, rewards, strict=True)]
    return g.model_copy(update={"completions": completions, "rewards": rewards, "reward_details": details})


def publish(bus: RedisBus, groups: list[TrajectoryGroup]) -> None:
    for g in groups:
        assert bus.publish_prompt(g.prompt.prompt_id, b"as fed")  # the feeder's dedup marks
        assert bus.publish_group(g.group_id, encode_group(g))
    bus.ack("prompts", [e.entry_id for e in bus.read("prompts", "worker", len(groups))])  # sampled


def test_the_filter_on_equal_and_unequal_rewards() -> None:
    # All equal: every advantage (r − mean) is 0, whatever the value; one differing reward is signal.
    assert equal_rewards(scored(0, [1.0, 1.0, 1.0])) and equal_rewards(scored(1, [0.0, 0.0, 0.0]))
    assert not equal_rewards(scored(2, [1.0, 0.0, 1.0])) and not equal_rewards(scored(3, [0.5, 0.25]))
    assert equal_rewards(scored(4, [0.7]))  # a group of one has advantage 0 too
    assert filtered(scored(0, [1.0, 1.0, 1.0]), ON) and not filtered(scored(2, [1.0, 0.0, 1.0]), ON)
    off = LearnerSettings()
    assert not filtered(scored(0, [1.0, 1.0]), off) and not out_of_loss(scored(0, [1.0, 1.0]), off)
    assert out_of_loss(scored(0, [1.0, 1.0, 1.0]), LearnerSettings(advantage={"drop_equal_groups": True}))


def test_a_batch_is_filled_with_informative_groups(bus_settings: BusSettings, tmp_path: Path) -> None:
    """prompts_per_step 2: the stream holds equal, informative, equal, equal, informative, informative.
    The batch is the first two informative groups; the three equal ones are set aside as they are read
    (recorded, marked, acknowledged), so only the informative ones stay pending."""
    rewards = [[1, 1], [1, 0], [0, 0], [1, 1], [0, 1], [1, 0]]
    groups = [scored(i, [float(r) for r in rs]) for i, rs in enumerate(rewards)]
    with RedisBus(bus_settings.model_copy(update={"trajectory_maxlen": 64})) as bus:
        publish(bus, groups)
        c = BatchCollector(bus, ON, LIMITS, filtered_log=FilteredLog(bus, tmp_path))
        batch = c.fill(0, 2, lambda: False)
        assert batch is not None and batch.filtered == 3
        assert [g.group_id for g in batch.groups] == [groups[1].group_id, groups[4].group_id]
        assert [g.group_id for g in c.groups] == [groups[5].group_id]
        assert c.take_acked() == 3 and bus.pending_info("trajectories").pending == 3
        aside = {groups[i].group_id for i in (0, 2, 3)}
        assert all(bus.get_value(TRAINED_PREFIX + gid) == b"filtered" for gid in aside)
        (record,) = [json.loads(line) for line in (tmp_path / FILTERED_TRAIL).read_text().splitlines()]
        assert record == {"version": 0, "group_ids": [groups[i].group_id for i in (0, 2, 3)]}
        ledger, state = Ledger(bus, tmp_path, saved_step=0, fresh=True), TrainState()
        ledger.commit(state, batch)
        assert (state.groups_trained, state.groups_filtered) == (2, 3)
        assert FilteredLog(bus, tmp_path).ids == aside  # the record's count survives a restart


def test_a_stale_uninformative_group_is_filtered_not_sent_back(
    bus_settings: BusSettings, tmp_path: Path
) -> None:
    with RedisBus(bus_settings.model_copy(update={"trajectory_maxlen": 64})) as bus:
        old_equal, fresh = scored(0, [1.0, 1.0], version=0), [scored(i, [1.0, 0.0], 9) for i in (1, 2)]
        publish(bus, [old_equal, *fresh])
        c = BatchCollector(bus, ON, LIMITS, filtered_log=FilteredLog(bus, tmp_path))
        batch = c.fill(9, 2, lambda: False)  # at version 9, version 0 is far past reach
        assert batch is not None and (batch.dropped_stale, batch.filtered) == (0, 1)
        assert bus.pending_info("prompts").lag == 0  # its prompt is not fed again


def test_a_wipe_rebuilds_the_marks_of_filtered_groups(bus_settings: BusSettings, tmp_path: Path) -> None:
    with RedisBus(bus_settings) as bus:
        equal = [scored(i, [0.0, 0.0]) for i in range(2)]
        publish(bus, equal)
        log = FilteredLog(bus, tmp_path)
        entries = bus.read("trajectories", "learner", 2)
        assert log.set_aside(equal, entries, 0) == 2
        watch = WipeWatch(bus, tmp_path / "trained_groups.jsonl", tmp_path / FILTERED_TRAIL)
        new_incarnation(bus)  # what a Redis that came back empty looks like to the learner
        for g in equal:
            bus.set_value(TRAINED_PREFIX + g.group_id, "")  # …and its marks gone (an empty value here)
        assert watch.check()
        assert all(bus.get_value(TRAINED_PREFIX + g.group_id) == b"filtered" for g in equal)


def test_the_data_may_end_with_filtered_groups_alone(bus_settings: BusSettings, tmp_path: Path) -> None:
    """The data ran out and every group left was uninformative: no step is taken for them (they are used
    already), and the end reason counts them."""
    with RedisBus(bus_settings) as bus:
        publish(bus, [scored(i, [0.0, 0.0]) for i in range(2)])
        mark_fed(bus, FeedReport(published=2, duplicates=0, seconds=0.0), epochs=1)
        c = BatchCollector(bus, ON, LIMITS, filtered_log=FilteredLog(bus, tmp_path))
        started = time.monotonic()
        assert c.fill(0, 2, lambda: time.monotonic() - started > 30) is None
        assert c.exhausted == (
            "the data ran out: all 2 prompts fed (1 epoch) were used, 0 trained and 2 filtered (all their "
            "answers scored alike)"
        )
        assert c.counts is not None and (c.counts.filtered, c.counts.dropped) == (2, 0)


def test_lockstep_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"unset lockstep_groups.*or set filter_groups none"):
        load_settings("onpolicy", ["learner.filter_groups=zero_variance"])
    assert load_settings("demo", ["learner.filter_groups=zero_variance"]).learner.filter_groups != "none"
