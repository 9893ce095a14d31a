"""The Redis bus against a real, private redis-server: delivery, idempotency, reclaim, dead letters,
back-pressure, reconnects, presence."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
import redis

from sparkrl.services.common.bus import (
    BusBackpressureTimeout,
    BusError,
    BusStopping,
    BusUnavailable,
    QueueDepth,
    RedisBus,
    StreamKind,
)
from sparkrl.services.common.bus.reconnect import STOPPING_RECONNECT_S
from sparkrl.services.common.settings import BusSettings

if TYPE_CHECKING:
    from conftest import RedisServer


@pytest.fixture
def bus(bus_settings: BusSettings) -> Iterator[RedisBus]:
    with RedisBus(bus_settings) as bus:
        yield bus


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    """A plain client, to look at the streams behind the bus's back."""
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    yield client
    client.close()


def drain(bus: RedisBus, kind: StreamKind, consumer: str) -> list[str]:
    """Read and ack until nothing is left; the item ids in delivery order."""
    seen: list[str] = []
    while batch := bus.read(kind, consumer, count=10, block_ms=0):
        seen += [entry.item_id for entry in batch]
        bus.ack(kind, [entry.entry_id for entry in batch])
    return seen


def strict_json(payload: bytes) -> dict[str, object]:
    """A decoder like the codec's: it names the missing field."""
    data = json.loads(payload)
    if "answer" not in data:
        raise ValueError("field 'answer' is required")
    return data


# ── delivery ──────────────────────────────────────────────────────────────────────────────────────────


def test_round_trip_delivers_once_and_ack_deletes(bus: RedisBus, raw: redis.Redis) -> None:
    for i in range(3):
        assert bus.publish_prompt(f"p{i}", f"payload {i}".encode())
    batch = bus.read("prompts", "w1", count=10)
    assert [(e.item_id, e.payload, e.deliveries) for e in batch] == [
        (f"p{i}", f"payload {i}".encode(), 1) for i in range(3)
    ]
    assert bus.pending_info("prompts") == QueueDepth(lag=0, pending=3)
    assert bus.read("prompts", "w2", count=10, block_ms=20) == []  # a group hands each entry out once
    assert bus.ack("prompts", [e.entry_id for e in batch]) == 3
    assert bus.pending_info("prompts") == QueueDepth(lag=0, pending=0)
    assert raw.xlen(bus.stream_key("prompts")) == 0  # acked entries are deleted


def test_pending_info_counts_undelivered_and_pending(bus: RedisBus) -> None:
    for i in range(5):
        bus.publish_group(f"g{i}", b"x")
    batch = bus.read("trajectories", "learner-0", count=2)
    assert bus.pending_info("trajectories") == QueueDepth(lag=3, pending=2)
    bus.ack("trajectories", [e.entry_id for e in batch])
    assert bus.pending_info("trajectories") == QueueDepth(lag=3, pending=0)


def test_publish_is_idempotent(bus: RedisBus) -> None:
    assert bus.publish_group("g1", b"first") is True
    assert bus.publish_group("g1", b"retry") is False
    assert bus.publish_prompt("g1", b"a prompt may share the id of a group") is True
    assert bus.publish_prompt("g1", b"again") is False
    batch = bus.read("trajectories", "learner-0", count=10)
    assert [(e.item_id, e.payload) for e in batch] == [("g1", b"first")]


def test_concurrent_publishers_add_each_group_once(bus_settings: BusSettings, bus: RedisBus) -> None:
    added: list[int] = []

    def publish_all() -> None:
        with RedisBus(bus_settings) as own:
            added.append(sum(own.publish_group(f"g{i}", b"x") for i in range(60)))

    threads = [threading.Thread(target=publish_all) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert sum(added) == 60
    assert sorted(drain(bus, "trajectories", "learner-0")) == sorted(f"g{i}" for i in range(60))


# ── reclaim and dead letters ──────────────────────────────────────────────────────────────────────────


def test_dead_consumers_entries_are_reclaimed_once(bus: RedisBus, raw: redis.Redis) -> None:
    ids = [f"p{i}" for i in range(10)]
    for prompt_id in ids:
        bus.publish_prompt(prompt_id, b"x")
    held = bus.read("prompts", "dies", count=6)  # read, then the worker dies: never acked
    assert len(held) == 6
    got = drain(bus, "prompts", "lives")
    assert got == ids[6:]  # not yet idle long enough: the dead worker's entries stay put
    time.sleep(0.25)  # > claim_idle_ms (200)
    reclaimed = bus.read("prompts", "lives", count=10)
    assert [e.item_id for e in reclaimed] == ids[:6]
    assert {e.deliveries for e in reclaimed} == {2}
    bus.ack("prompts", [e.entry_id for e in reclaimed])
    got += [e.item_id for e in reclaimed]
    assert sorted(got) == sorted(ids)  # nothing lost, nothing twice
    assert raw.xlen(bus.stream_key("prompts")) == 0
    assert bus.pending_info("prompts") == QueueDepth(lag=0, pending=0)


def test_touch_keeps_a_slow_consumers_entries(bus_settings: BusSettings) -> None:
    with RedisBus(bus_settings.model_copy(update={"claim_idle_ms": 400})) as bus:
        bus.publish_group("g0", b"x")
        (held,) = bus.read("trajectories", "learner-0", count=1)
        for _ in range(5):  # holds it 0.5 s > claim_idle_ms, touching every 0.1 s
            time.sleep(0.1)
            assert bus.touch("trajectories", "learner-0", [held.entry_id]) == 1
        assert bus.read("trajectories", "learner-0", count=1, block_ms=0) == []  # not handed out again
        time.sleep(0.45)
        (again,) = bus.read("trajectories", "learner-1", count=1, block_ms=0)  # untouched: reclaimed
        assert (again.entry_id, again.deliveries) == (held.entry_id, 2)  # touches were not deliveries


def test_entry_delivered_too_often_is_dead_lettered(bus_settings: BusSettings, raw: redis.Redis) -> None:
    with RedisBus(bus_settings.model_copy(update={"max_deliveries": 2})) as bus:
        bus.publish_prompt("poison", b"crashes every worker")
        for consumer in ("a", "b"):
            assert [e.item_id for e in bus.read("prompts", consumer, count=1)] == ["poison"]
            time.sleep(0.25)  # the consumer "crashed": its entry idles past claim_idle_ms
        assert bus.read("prompts", "c", count=1, block_ms=0) == []
        (dead,) = bus.dead_letters()
        assert dead.reason == "delivered 2 times without ack"
        assert (dead.item_id, dead.payload, dead.deliveries) == ("poison", b"crashes every worker", 3)
        assert dead.stream == bus.stream_key("prompts")
        assert raw.xlen(bus.stream_key("prompts")) == 0
        assert bus.pending_info("prompts") == QueueDepth(lag=0, pending=0)


def test_read_decoded_dead_letters_malformed_payloads(bus: RedisBus, raw: redis.Redis) -> None:
    bus.publish_prompt("good", b'{"prompt": "1+1", "answer": "2"}')
    bus.publish_prompt("no-answer", b'{"prompt": "1+1"}')
    bus.publish_prompt("not-json", b"\xff\x00")
    raw.xadd(bus.stream_key("prompts"), {"id": "bare"})  # written by a buggy producer: no payload field
    decoded = bus.read_decoded("prompts", "w1", count=10, decode=strict_json)
    assert [(e.item_id, value) for e, value in decoded] == [("good", {"prompt": "1+1", "answer": "2"})]
    reasons = {d.item_id: d.reason for d in bus.dead_letters()}
    assert reasons.keys() == {"no-answer", "not-json", "bare"}
    assert "field 'answer' is required" in reasons["no-answer"]
    assert "payload" in reasons["bare"]
    assert bus.pending_info("prompts") == QueueDepth(lag=0, pending=1)  # only the good one awaits its ack


def test_dead_letter_stream_is_capped(bus_settings: BusSettings, raw: redis.Redis) -> None:
    with RedisBus(bus_settings.model_copy(update={"dead_letter_maxlen": 16})) as bus:
        for i in range(300):
            bus.publish_group(f"g{i}", b"bad")
        for entry in bus.read("trajectories", "learner-0", count=300):
            assert bus.dead_letter("trajectories", entry, "bad")
        # MAXLEN ~ trims whole radix-tree nodes (100 entries each), so "about 16" is at most one node more.
        assert raw.xlen(bus.stream_key("dead")) <= 16 + 100
        assert raw.xlen(bus.stream_key("trajectories")) == 0


def test_dead_letter_of_an_acked_entry_records_nothing(bus: RedisBus) -> None:
    bus.publish_prompt("p", b"x")
    (entry,) = bus.read("prompts", "w1", count=1)
    bus.ack("prompts", [entry.entry_id])
    assert bus.dead_letter("prompts", entry, "too late") is False
    assert bus.dead_letters() == []


# ── back-pressure ─────────────────────────────────────────────────────────────────────────────────────


def test_backpressure_blocks_producer_until_consumer_acks(
    bus_settings: BusSettings, raw: redis.Redis
) -> None:
    with RedisBus(bus_settings.model_copy(update={"trajectory_maxlen": 4})) as bus:
        for i in range(4):
            bus.publish_group(f"g{i}", b"x")
        outcome: list[bool] = []
        producer = threading.Thread(
            target=lambda: outcome.append(bus.publish_group("g4", b"x", timeout_s=10))
        )
        producer.start()
        time.sleep(0.3)
        assert producer.is_alive() and outcome == []  # full: the producer waits
        assert raw.xlen(bus.stream_key("trajectories")) == 4
        batch = bus.read("trajectories", "learner-0", count=1)
        time.sleep(0.3)
        assert producer.is_alive()  # read but not acked still counts: pending entries hold their place
        bus.ack("trajectories", [e.entry_id for e in batch])
        producer.join(timeout=5)
        assert outcome == [True]
        rest = drain(bus, "trajectories", "learner-0")
        assert [e.item_id for e in batch] + rest == [f"g{i}" for i in range(5)]  # nothing trimmed


def test_backpressure_times_out_clearly_and_trims_nothing(
    bus_settings: BusSettings, raw: redis.Redis
) -> None:
    with RedisBus(bus_settings.model_copy(update={"trajectory_maxlen": 4})) as bus:
        for i in range(4):
            bus.publish_group(f"g{i}", b"x")
        started = time.monotonic()
        with pytest.raises(BusBackpressureTimeout, match=r":trajectories held 4 .*'learner'"):
            bus.publish_group("g4", b"x", timeout_s=0.3)
        assert 0.3 <= time.monotonic() - started < 2
        assert drain(bus, "trajectories", "learner-0") == [f"g{i}" for i in range(4)]
        assert bus.publish_group("g4", b"x")  # the refused id was not marked published


# ── robustness ────────────────────────────────────────────────────────────────────────────────────────


def _restart_later(server: RedisServer, delay_s: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay_s), server.start()))
    thread.start()
    return thread


def test_bus_recovers_when_redis_restarts(
    spawn_redis: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    # Persistent, as in production: a restart must keep the unread entries and the group.
    server = spawn_redis("--appendonly", "yes", "--appendfsync", "always")
    settings = BusSettings(
        url=server.url, namespace="restart", block_ms=50, socket_timeout_s=1, reconnect_max_s=10
    )
    with RedisBus(settings) as bus:
        bus.publish_prompt("p0", b"x")
        bus.publish_prompt("p1", b"x")
        (first,) = bus.read("prompts", "w1", count=1)
        bus.ack("prompts", [first.entry_id])
        server.stop()
        restarter = _restart_later(server, 0.5)
        with caplog.at_level(logging.WARNING, logger="sparkrl.bus"):
            assert bus.publish_prompt("p2", b"x")  # waits out the outage, then succeeds
        restarter.join(timeout=10)
        assert any("reconnect attempt" in r.getMessage() for r in caplog.records)
        assert drain(bus, "prompts", "w1") == ["p1", "p2"]
        assert bus.publish_prompt("p1", b"x") is False  # idempotency survived the restart


def test_bus_recreates_a_group_that_vanished(bus: RedisBus, raw: redis.Redis) -> None:
    bus.publish_prompt("p0", b"x")
    raw.flushdb()  # what a restart without persistence looks like to the bus
    bus.publish_prompt("p1", b"x")
    assert drain(bus, "prompts", "w1") == ["p1"]
    assert bus.pending_info("prompts") == QueueDepth(lag=0, pending=0)


def test_unavailable_after_reconnect_max(spawn_redis: Callable[..., RedisServer]) -> None:
    server = spawn_redis()
    settings = BusSettings(
        url=server.url, namespace="gone", block_ms=50, socket_timeout_s=1, reconnect_max_s=0.5
    )
    with RedisBus(settings) as bus:
        bus.publish_prompt("p0", b"x")
        server.stop()
        started = time.monotonic()
        with pytest.raises(BusUnavailable, match=re.escape(f"Redis at {server.url} unreachable")):
            bus.read("prompts", "w1", count=1)
        assert 0.5 <= time.monotonic() - started < 3


def test_a_stop_ends_the_reconnecting_and_says_so(
    spawn_redis: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    """A service told to stop while Redis is down does not reconnect for reconnect_max_s (60 s here): the
    call in hand gives up STOPPING_RECONNECT_S after the stop with BusStopping, and later calls at once."""
    server = spawn_redis()
    settings = BusSettings(
        url=server.url, namespace="stop", block_ms=50, socket_timeout_s=1, reconnect_max_s=60
    )
    stop = threading.Event()
    with RedisBus(settings, stop) as bus:
        bus.publish_prompt("p0", b"x")
        server.stop()
        outcome: list[BaseException] = []

        def read() -> None:
            try:
                bus.read("prompts", "w1", count=1)
            except BusError as exc:
                outcome.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(timeout=1.0)
        assert reader.is_alive(), "the read gave up before the stop: it should reconnect for 60 s"
        stop.set()
        reader.join(timeout=STOPPING_RECONNECT_S + 20)  # a hang reads as 60 s; the bound is not a timing
        assert not reader.is_alive(), "a stopped service still reconnects"
        (exc,) = outcome
        assert isinstance(exc, BusStopping) and "while stopping" in str(exc)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sparkrl.bus"), pytest.raises(BusStopping):
            bus.pending_info("prompts")  # one call waited for the stop: the next does not wait again
        assert not [r for r in caplog.records if "reconnect attempt" in r.getMessage()]


def test_a_stopping_service_rides_out_a_blip(spawn_redis: Callable[..., RedisServer]) -> None:
    """Stopping does not mean giving up at once: a Redis back within STOPPING_RECONNECT_S takes the call
    (a clean stop still hands over what it holds)."""
    server = spawn_redis("--appendonly", "yes", "--appendfsync", "always")
    settings = BusSettings(
        url=server.url, namespace="blip", block_ms=50, socket_timeout_s=1, reconnect_max_s=60
    )
    stop = threading.Event()
    stop.set()
    with RedisBus(settings, stop) as bus:
        bus.publish_prompt("p0", b"x")
        server.stop()
        restarter = _restart_later(server, 0.3)
        assert bus.publish_prompt("p1", b"x")
        restarter.join(timeout=10)
        assert drain(bus, "prompts", "w1") == ["p0", "p1"]


def test_block_ms_must_stay_below_socket_timeout(bus_settings: BusSettings) -> None:
    with pytest.raises(ValueError, match="block_ms"):
        RedisBus(bus_settings.model_copy(update={"block_ms": 3000, "socket_timeout_s": 2.0}))


def test_password_is_masked_in_messages(bus_settings: BusSettings) -> None:
    masked = bus_settings.model_copy(update={"url": "redis://:s3cret@127.0.0.1:1/0"})
    assert RedisBus(masked).url == "redis://:***@127.0.0.1:1/0"


# ── presence and announcements ────────────────────────────────────────────────────────────────────────


def test_statuses_expire_after_ttl(bus: RedisBus) -> None:
    bus.put_status("rollout", "w1", '{"version": 3}', ttl_s=0.3)
    bus.put_status("rollout", "w2", '{"version": 4}', ttl_s=30)
    bus.put_status("learner", "l0", "{}", ttl_s=30)
    assert bus.statuses("rollout") == {"w1": '{"version": 3}', "w2": '{"version": 4}'}
    time.sleep(0.4)
    assert bus.statuses("rollout") == {"w2": '{"version": 4}'}  # w1 stopped reporting: gone
    assert bus.statuses("learner") == {"l0": "{}"}


def test_values_round_trip(bus: RedisBus) -> None:
    assert bus.get_value("weights") is None
    bus.set_value("weights", '{"version": 7, "sha256": "ab"}')
    assert bus.get_value("weights") == b'{"version": 7, "sha256": "ab"}'


def test_the_feeder_waits_on_a_full_prompt_stream_as_long_as_it_takes(bus_settings: BusSettings) -> None:
    """A producer fails after `publish_timeout_s` on a full stream; the feeder does not (a paused run holds
    its prompts for hours): it goes on once the fleet takes some, and returns when told to stop."""
    from sparkrl.services.common.feeder import feed_prompts
    from sparkrl.services.common.settings import PromptSettings
    from sparkrl.services.common.tasks.datasets import iter_prompts

    settings = bus_settings.model_copy(update={"prompt_maxlen": 16, "publish_timeout_s": 0.3})
    prompts = list(iter_prompts(PromptSettings(task="countdown", count=40, seed=3)))
    stop = threading.Event()
    reports = []
    with RedisBus(settings) as feeding, RedisBus(settings) as fleet:
        feeder = threading.Thread(target=lambda: reports.append(feed_prompts(feeding, prompts, stop=stop)))
        feeder.start()
        time.sleep(1.5)  # five publish timeouts on a full stream
        assert feeder.is_alive() and fleet.pending_info("prompts").lag == 16
        taken = fleet.read("prompts", "w0", count=20, block_ms=0)
        fleet.ack("prompts", [e.entry_id for e in taken])
        deadline = time.monotonic() + 10
        while fleet.pending_info("prompts").lag < 16 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fleet.pending_info("prompts").lag == 16  # refilled: 32 of the 40 fed, the rest waiting
        stop.set()
        feeder.join(timeout=5)
        assert not feeder.is_alive() and reports[0].published == 32
