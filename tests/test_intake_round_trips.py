"""The learner's intake asks Redis for the trained marks once per read, not once per group (issue 35: that
lookup, waiting its turn behind the fleet's publishes, capped the groups the intake took per second), and
takes exactly what it took before: the replays acknowledged, the rest held in arrival order.

Counted by a private redis-server's own `INFO commandstats`, never timed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import redis
from conftest import RedisServer

from sparkrl.proto import TrajectoryGroup, encode_group
from sparkrl.proto.testing import random_group
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.recovery import TRAINED_PREFIX
from sparkrl.services.common.settings import BusSettings, LearnerSettings
from sparkrl.services.learner.collect import BatchCollector
from sparkrl.services.learner.ledger import trained, trained_among
from sparkrl.services.learner.validate import ModelLimits

LIMITS = ModelLimits(vocab_size=260, max_len=None, needs_topk=True)


def group(seed: int) -> TrajectoryGroup:
    g = random_group(np.random.default_rng(seed), n=2, T=4, k=4, vocab_size=260, max_new_tokens=8)
    completions = [
        c.model_copy(update={"policy_versions": np.zeros_like(c.policy_versions)}) for c in g.completions
    ]
    return g.model_copy(update={"completions": completions})


def calls(client: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in client.info("commandstats").items()}


def private_bus(server: RedisServer) -> RedisBus:
    """A bus on a server of its own: every command it counts is this test's."""
    return RedisBus(BusSettings(url=server.url, namespace="t", block_ms=50, socket_timeout_s=5.0))


def test_a_read_looks_its_marks_up_at_once_and_takes_what_it_took(
    spawn_redis: Callable[..., RedisServer],
) -> None:
    server = spawn_redis()
    client = redis.Redis.from_url(server.url)
    with private_bus(server) as bus:
        groups = [group(i) for i in range(12)]
        replays = groups[::3]  # trained by an earlier step: marked, as Ledger.commit marks them
        bus.set_values({TRAINED_PREFIX + g.group_id: "1" for g in replays}, ttl_s=600)
        for g in groups:
            assert bus.publish_group(g.group_id, encode_group(g))
        client.config_resetstat()
        collector = BatchCollector(bus, LearnerSettings(prompts_per_step=8), LIMITS)
        batch = collector.fill(0, 2, lambda: False)
        counted = calls(client)
    assert batch is not None
    fresh = [g for g in groups if g not in replays]
    assert [g.group_id for g in batch.groups] == [g.group_id for g in fresh]  # arrival order
    assert collector.take_acked() == len(replays)  # the replays acknowledged, not trained again
    # One lookup for the read (12 groups, itself several XREADGROUPs: bus/reads.py), none per group.
    assert counted.get("get", 0) == 0
    assert counted["mget"] == 1


def test_trained_among_reads_every_mark_in_order_a_thousand_at_a_time(
    spawn_redis: Callable[..., RedisServer],
) -> None:
    server = spawn_redis()
    client = redis.Redis.from_url(server.url)
    with private_bus(server) as bus:
        ids = [f"g-{i:05d}" for i in range(2_500)]
        marked = set(ids[1::7])
        bus.set_values({TRAINED_PREFIX + i: "3" for i in marked}, ttl_s=600)
        client.config_resetstat()
        assert trained_among(bus, ids) == marked
        assert trained_among(bus, []) == set()
        assert calls(client)["mget"] == 3  # 2,500 ids: three round trips; none for no ids
        assert all(trained(bus, i) == (i in marked) for i in ids[:50])  # the one-id lookup agrees
        assert bus.get_values(["x", "missing", "y"]) == [None, None, None]
        bus.set_values({"x": "1", "y": "2"})
        assert bus.get_values(["x", "missing", "y"]) == [b"1", None, b"2"]
