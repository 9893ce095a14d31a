"""A large read of a stream takes its first chunk as before and the rest over several connections at once
(services/common/bus/reads.py: behind a fleet's publishes Redis writes each connection about one reply
block a turn, so one connection drained a backlog a group a turn). What a read returns is unchanged:
every entry once, in stream order, pending under the consumer until acknowledged. On a private
redis-server, counted by its own `INFO`, never timed."""

from __future__ import annotations

from collections.abc import Callable

import redis
from conftest import RedisServer

from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.bus.reads import CHUNK
from sparkrl.services.common.settings import BusSettings


def bus_on(server: RedisServer) -> RedisBus:
    return RedisBus(BusSettings(url=server.url, namespace="t", block_ms=200, socket_timeout_s=5.0))


def order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


def xreadgroups(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0))


def test_a_large_read_is_every_entry_once_in_order_over_several_connections(
    spawn_redis: Callable[..., RedisServer],
) -> None:
    server = spawn_redis()
    client = redis.Redis.from_url(server.url)
    with bus_on(server) as bus:
        published = [f"g{i}" for i in range(10 * CHUNK + 3)]
        for item in published:
            assert bus.publish_group(item, item.encode() * 1000)
        before = client.info("clients")["connected_clients"]
        entries = bus.read("trajectories", "learner", count=len(published) + 5)
        assert [e.item_id for e in entries] == published  # each once, in stream order
        assert [e.payload for e in entries] == [item.encode() * 1000 for item in published]
        assert sorted(entries, key=lambda e: order(e.entry_id)) == entries
        assert all(e.deliveries == 1 for e in entries)
        # The first chunk, then the rest over up to READERS connections (threads that finish first hand
        # theirs back to the pool, so at least one more), a chunk per call.
        assert xreadgroups(client) > len(published) // CHUNK
        assert client.info("clients")["connected_clients"] > before
        assert bus.pending_info("trajectories").pending == len(published)
        assert bus.ack("trajectories", [e.entry_id for e in entries]) == len(published)
        assert bus.read("trajectories", "learner", count=10, block_ms=0) == []


def test_a_small_read_is_one_call_and_waits_only_while_empty(
    spawn_redis: Callable[..., RedisServer],
) -> None:
    server = spawn_redis()
    client = redis.Redis.from_url(server.url)
    with bus_on(server) as bus:
        for item in ("a", "b", "c"):
            assert bus.publish_group(item, b"x")
        client.config_resetstat()
        entries = bus.read("trajectories", "learner", count=100)
        assert [e.item_id for e in entries] == ["a", "b", "c"]
        assert xreadgroups(client) == 1  # fewer than a chunk came: nothing more was waiting
        assert bus.read("trajectories", "learner", count=100, block_ms=50) == []
