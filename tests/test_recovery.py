"""Recovering from a Redis that lost its data: the learner and the feeder agree on the incarnation from
the start, so a wipe is noticed however early it comes (a real redis-server, emptied with FLUSHDB)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import redis

from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.feeder import FeedReport, watch_and_refeed
from sparkrl.services.common.recovery import TRAINED_PREFIX, WipeWatch, ensure_incarnation, incarnation
from sparkrl.services.common.settings import BusSettings


def test_a_wipe_right_after_start_is_still_refed(bus_settings: BusSettings, tmp_path: Path) -> None:
    trail = tmp_path / "trained_groups.jsonl"
    trail.write_text(json.dumps({"step": 1, "group_ids": ["g-1", "g-2"]}) + "\n{torn")
    refeeds: list[int] = []
    stop = threading.Event()
    with RedisBus(bus_settings) as feeder_bus, RedisBus(bus_settings) as learner_bus:
        known = ensure_incarnation(feeder_bus)  # the feeder starts first, before any learner
        wipes = WipeWatch(learner_bus, trail)
        assert wipes.known == known and not wipes.check()
        # Wiped before the feeder's watch ever polled: it must still see the change.
        redis.Redis.from_url(bus_settings.url).flushdb()
        assert incarnation(learner_bus) is None
        assert wipes.check()  # rebuilt the marks, set a new incarnation
        assert learner_bus.get_value(TRAINED_PREFIX + "g-2") == b"1"
        watcher = threading.Thread(
            target=watch_and_refeed,
            args=(feeder_bus, lambda: refeeds.append(1) or FeedReport(1, 0, 0.0), stop, known, 0.02),
        )
        watcher.start()
        try:
            deadline = threading.Event()
            for _ in range(250):
                if refeeds or deadline.wait(0.02):
                    break
        finally:
            stop.set()
            watcher.join(5)
    assert refeeds == [1]
    assert not wipes.check()  # nothing changed since the rebuild


def test_ensure_incarnation_keeps_what_is_there(bus_settings: BusSettings) -> None:
    with RedisBus(bus_settings) as bus:
        first = ensure_incarnation(bus)
        assert ensure_incarnation(bus) == first == incarnation(bus)
