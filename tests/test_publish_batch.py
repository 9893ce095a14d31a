"""A worker's batch goes out in two round trips: its groups offered in one pipeline, then the prompts of
those the bus took acknowledged in one call. What it publishes, acknowledges, leaves in hand or hands
back is what the one-by-one loop did: replays acked but not new, doomed groups kept for remaking, groups a
full stream refused published one by one once there is room, and nothing acked that is not in the stream.

A private redis-server; its own `INFO commandstats` counts the commands, nothing is timed."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import redis
from conftest import RedisServer

from sparkrl.proto import TrajectoryGroup, decode_group, encode_group, encode_message
from sparkrl.proto.testing import random_group
from sparkrl.services.common.bus import Entry, RedisBus
from sparkrl.services.common.settings import BusSettings
from sparkrl.services.rollout.publish import publish_groups

WORKER = "worker-0"


def groups(count: int) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(7)
    return [random_group(rng, n=2, T=3, k=4, vocab_size=260, max_new_tokens=4) for _ in range(count)]


def prompts_in_hand(bus: RedisBus, made: list[TrajectoryGroup]) -> list[Entry]:
    """Each group's prompt fed and taken by the worker, as `pull_prompts` leaves them: pending, unacked."""
    for group in made:
        assert bus.publish_prompt(group.prompt.prompt_id, encode_message(group.prompt))
    entries = bus.read("prompts", WORKER, len(made), block_ms=0)
    assert [e.item_id for e in entries] == [g.prompt.prompt_id for g in made]
    return entries


def in_stream(bus: RedisBus) -> list[str]:
    """Group ids in the trajectory stream, oldest first."""
    return [decode_group(e.payload).group_id for e in bus.read("trajectories", "learner", 100, block_ms=0)]


def calls(client: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in client.info("commandstats").items()}


def never(group: TrajectoryGroup) -> bool:
    return False


def test_a_batch_is_offered_in_one_pipeline_and_its_prompts_acked_in_one_call(
    spawn_redis: Callable[..., RedisServer],
) -> None:
    server = spawn_redis()
    client = redis.Redis.from_url(server.url)
    settings = BusSettings(url=server.url, namespace="t", block_ms=50, socket_timeout_s=5.0)
    with RedisBus(settings) as bus:
        made = groups(6)
        entries = prompts_in_hand(bus, made)
        assert bus.publish_group(made[2].group_id, encode_group(made[2]))  # a replay: published before
        client.config_resetstat()
        out = publish_groups(bus, made, entries, threading.Event(), lambda left: None, never)
        counted = calls(client)
        assert out.new == 5 and out.done == list(range(6)) and out.redo == []
        assert counted.get("xack") == 1 and counted.get("xdel") == 1  # every prompt in one ack
        assert counted.get("evalsha") == 6  # each group's atomic add, all in one pipeline
        assert bus.pending_info("prompts").pending == 0
        assert in_stream(bus) == [made[2].group_id] + [g.group_id for i, g in enumerate(made) if i != 2]


def test_a_doomed_group_is_not_published_and_its_prompt_stays_in_hand(bus_settings: BusSettings) -> None:
    with RedisBus(bus_settings) as bus:
        made = groups(4)
        entries = prompts_in_hand(bus, made)
        out = publish_groups(bus, made, entries, threading.Event(), lambda left: None, lambda g: g is made[1])
        assert out.done == [0, 2, 3] and out.redo == [1] and out.new == 3
        assert bus.pending_info("prompts").pending == 1  # the doomed group's prompt: to be made again
        assert in_stream(bus) == [made[i].group_id for i in (0, 2, 3)]


def test_groups_a_full_stream_refused_go_out_one_by_one_once_the_learner_makes_room(
    bus_settings: BusSettings,
) -> None:
    settings = bus_settings.model_copy(update={"trajectory_maxlen": 4})
    with RedisBus(settings) as bus:
        made = groups(6)
        entries = prompts_in_hand(bus, made)
        waited: list[int] = []

        def learner_takes_two(left: int) -> None:  # between tries: the learner trains and acks two
            waited.append(left)
            taken = bus.read("trajectories", "learner", 2, block_ms=0)
            bus.ack("trajectories", [e.entry_id for e in taken])

        out = publish_groups(bus, made, entries, threading.Event(), learner_takes_two, never)
        assert out.done == list(range(6)) and out.new == 6 and out.redo == []
        assert waited and waited[0] == 2  # the two refused were in hand while it waited
        assert bus.pending_info("prompts").pending == 0
        assert in_stream(bus) == [g.group_id for g in made[2:]]  # the first two were trained meanwhile


def test_a_stop_while_the_stream_is_full_leaves_the_refused_groups_unacked(bus_settings: BusSettings) -> None:
    settings = bus_settings.model_copy(update={"trajectory_maxlen": 4})
    with RedisBus(settings) as bus:
        made = groups(6)
        entries = prompts_in_hand(bus, made)
        stop = threading.Event()
        out = publish_groups(bus, made, entries, stop, lambda left: stop.set(), never)
        assert out.done == [0, 1, 2, 3] and out.redo == [] and out.new == 4
        assert bus.pending_info("prompts").pending == 2  # handed over or reclaimed, never lost
        assert in_stream(bus) == [g.group_id for g in made[:4]]


@pytest.mark.parametrize("count", [0, 1])
def test_an_empty_or_single_batch(bus_settings: BusSettings, count: int) -> None:
    with RedisBus(bus_settings) as bus:
        made = groups(count)
        out = publish_groups(bus, made, prompts_in_hand(bus, made) if made else [], threading.Event(),
                             lambda left: None, never)  # fmt: skip
        assert out.done == list(range(count)) and out.new == count
        assert bus.publish_groups_once([]) == []
