"""Dynamic sampling (`learner.filter_groups`, services/learner/dynamic_sampling.py) by hand: the filter on
groups of equal and unequal rewards, a batch filled with informative groups on a real redis-server (the
filtered ones riding along, never sent back, never counted), the ledger's account of them (journal,
marks, counts, audit trail, replay), the last step of filtered groups alone, and the refusal of
lockstep."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sparkrl.proto import TrajectoryGroup, encode_group
from sparkrl.proto.testing import random_group
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.recovery import TRAINED_PREFIX, trained_ids
from sparkrl.services.common.settings import BusSettings, LearnerSettings, load_settings
from sparkrl.services.learner.collect import BatchCollector
from sparkrl.services.learner.dynamic_sampling import equal_rewards, filtered, out_of_loss
from sparkrl.services.learner.ledger import Ledger
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


def test_the_filter_on_equal_and_unequal_rewards() -> None:
    # All equal: every advantage (r − mean) is 0, whatever the value; one differing reward is signal.
    assert equal_rewards(scored(0, [1.0, 1.0, 1.0])) and equal_rewards(scored(1, [0.0, 0.0, 0.0]))
    assert not equal_rewards(scored(2, [1.0, 0.0, 1.0])) and not equal_rewards(scored(3, [0.5, 0.25]))
    assert equal_rewards(scored(4, [0.7]))  # a group of one has advantage 0 too
    assert filtered(scored(0, [1.0, 1.0, 1.0]), ON) and not filtered(scored(2, [1.0, 0.0, 1.0]), ON)
    off = LearnerSettings()
    assert not filtered(scored(0, [1.0, 1.0, 1.0]), off) and not out_of_loss(scored(0, [1.0, 1.0, 1.0]), off)
    assert out_of_loss(scored(0, [1.0, 1.0, 1.0]), ON)  # the update leaves it out of the loss as well
    assert out_of_loss(scored(0, [1.0, 1.0, 1.0]), LearnerSettings(advantage={"drop_equal_groups": True}))


def test_a_batch_is_filled_with_informative_groups(bus_settings: BusSettings) -> None:
    """prompts_per_step 2: the stream holds equal, informative, equal, equal, informative, informative.
    The batch is the first two informative groups and the three filtered ones read before them; the
    third informative group waits for the next batch."""
    rewards = [[1, 1], [1, 0], [0, 0], [1, 1], [0, 1], [1, 0]]
    groups = [scored(i, [float(r) for r in rs]) for i, rs in enumerate(rewards)]
    with RedisBus(bus_settings.model_copy(update={"trajectory_maxlen": 64})) as bus:
        for g in groups:
            assert bus.publish_group(g.group_id, encode_group(g))
        c = BatchCollector(bus, ON, LIMITS)
        batch = c.fill(0, 2, lambda: False)
        assert batch is not None
        assert batch.trained_ids == [groups[1].group_id, groups[4].group_id]
        assert batch.filtered_ids == {groups[i].group_id for i in (0, 2, 3)}
        assert [g.group_id for g in c.groups] == [groups[5].group_id] and c.informative == 1


def test_a_filtered_group_is_never_sent_back_as_stale(bus_settings: BusSettings) -> None:
    with RedisBus(bus_settings.model_copy(update={"trajectory_maxlen": 64})) as bus:
        old_equal, fresh = scored(0, [1.0, 1.0], version=0), [scored(i, [1.0, 0.0], 9) for i in (1, 2)]
        for g in [old_equal, *fresh]:
            assert bus.publish_group(g.group_id, encode_group(g))
        batch = BatchCollector(bus, ON, LIMITS).fill(9, 2, lambda: False)  # version 9: 0 is far past reach
        assert batch is not None and batch.dropped_stale == 0
        assert batch.filtered_ids == {old_equal.group_id} and len(batch.trained_ids) == 2


def test_the_ledger_accounts_for_filtered_groups(bus_settings: BusSettings, tmp_path: Path) -> None:
    groups = [scored(0, [1.0, 0.0]), scored(1, [0.0, 0.0]), scored(2, [0.0, 1.0])]
    with RedisBus(bus_settings.model_copy(update={"trajectory_maxlen": 64})) as bus:
        for g in groups:
            assert bus.publish_group(g.group_id, encode_group(g))
        batch = BatchCollector(bus, ON, LIMITS).fill(0, 2, lambda: False)
        assert batch is not None and batch.filtered_ids == {groups[1].group_id}
        ledger, state = Ledger(bus, tmp_path, saved_step=0, fresh=True), TrainState(step=1)
        assert ledger.commit(state, batch) == 3  # every entry acknowledged, the filtered one's too
        assert (state.groups_trained, state.groups_filtered) == (2, 1)
        assert state.trained_group_ids == [groups[0].group_id, groups[2].group_id]
        assert state.filtered_group_ids == [groups[1].group_id]
        assert all(bus.get_value(TRAINED_PREFIX + g.group_id) == b"1" for g in groups)  # a redelivery: acked
        assert bus.pending_info("trajectories").pending == 0
        ((step, replayed),) = list(Ledger(bus, tmp_path, saved_step=0, fresh=False).replay(0))
        assert step == 1 and replayed.filtered_ids == batch.filtered_ids
        assert replayed.trained_ids == batch.trained_ids
    # The audit trail's record (reporting.RunLog) rebuilds the filtered group's mark after a wipe too.
    trail = tmp_path / "trained_groups.jsonl"
    record = {"step": 1, "group_ids": state.trained_group_ids, "filtered_ids": state.filtered_group_ids}
    trail.write_text(json.dumps(record) + "\n")
    assert {gid for gid, _ in trained_ids(trail)} == {g.group_id for g in groups}


def test_the_last_step_may_hold_filtered_groups_alone(bus_settings: BusSettings) -> None:
    """The data ran out with only filtered groups held: they still make a step (committed, not trained),
    or the run would wait for them forever."""
    from sparkrl.services.common.feeder import FEED_DONE

    with RedisBus(bus_settings) as bus:
        equal = [scored(i, [0.0, 0.0]) for i in range(2)]
        for g in equal:
            assert bus.publish_prompt(g.prompt.prompt_id, b"as fed")
            assert bus.publish_group(g.group_id, encode_group(g))
        bus.ack("prompts", [e.entry_id for e in bus.read("prompts", "worker", 2)])
        bus.set_value(FEED_DONE, json.dumps({"prompts": 2, "epochs": 1}))
        batch = BatchCollector(bus, ON, LIMITS).fill(0, 2, lambda: False)
        assert batch is not None and batch.trained_ids == [] and len(batch.filtered_ids) == 2


def test_lockstep_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"unset lockstep_groups.*or set filter_groups none"):
        load_settings("onpolicy", ["learner.filter_groups=zero_variance"])
    assert load_settings("demo", ["learner.filter_groups=zero_variance"]).learner.filter_groups != "none"
