"""The control service while Redis is down (a real redis-server, stopped and started; uvicorn on loopback):
every route that reads Redis answers within `control.redis_wait_s` — 503 naming that setting, `/metrics`
with `sparkrl_fleet_up 0` — instead of holding the request for `bus.reconnect_max_s` (60 s), past a
probe's, a scrape's or the page's own timeout. Once Redis is back, the same routes answer 200."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
from test_control_api import TOKEN, Server

from sparkrl.services.common.settings import BusSettings, ControlSettings
from sparkrl.services.control.app import create_app

if TYPE_CHECKING:
    from conftest import RedisServer

READS = ("/api/v1/status", "/api/v1/workers", "/healthz")
# Far below bus.reconnect_max_s: a request held for the bus's whole reconnect would time out here.
CLIENT_TIMEOUT_S = 30.0


def test_requests_answer_503_within_the_wait_while_redis_is_down(
    spawn_redis: Callable[..., RedisServer],
) -> None:
    server = spawn_redis()
    bus = BusSettings(url=server.url, namespace="down", reconnect_max_s=60)
    cfg = ControlSettings(token=TOKEN, redis_wait_s=0.5)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with Server(create_app(cfg, bus)) as control, httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
        for path in READS:
            assert client.get(control.url + path, headers=auth).status_code == 200, path
        server.stop()
        for path in READS:
            answer = client.get(control.url + path, headers=auth)
            assert answer.status_code == 503, (path, answer.text)
            assert "control.redis_wait_s=0.5" in answer.json()["detail"], answer.text
        scrape = client.get(control.url + "/metrics")
        assert scrape.status_code == 200 and "sparkrl_fleet_up 0.0" in scrape.text
        assert client.get(control.url + "/").status_code == 200  # the page itself needs no Redis
        server.start()
        for path in READS:
            assert client.get(control.url + path, headers=auth).status_code == 200, path
        assert "sparkrl_fleet_up 1.0" in client.get(control.url + "/metrics").text


def test_the_wait_is_never_longer_than_the_bus_reconnect(spawn_redis: Callable[..., RedisServer]) -> None:
    """A bus.reconnect_max_s below control.redis_wait_s is the one in force, and the message says so."""
    server = spawn_redis()
    bus = BusSettings(url=server.url, namespace="short", reconnect_max_s=0.3)
    with Server(create_app(ControlSettings(token=TOKEN), bus)) as control:
        server.stop()
        answer = httpx.get(control.url + "/api/v1/status", timeout=CLIENT_TIMEOUT_S)
        assert answer.status_code == 503 and "bus.reconnect_max_s=0.3" in answer.json()["detail"]
