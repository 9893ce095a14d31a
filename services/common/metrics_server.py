"""A service's own small HTTP endpoint: `GET /metrics` (Prometheus text format) and `GET /healthz`.

For the learner and the rollout workers, whose one loop is busy training or generating: a daemon thread
with its own server, so a scrape never waits for a step. Port 0 means off. Every other path is a 404.

Prometheus pulls: what a process changes after its last scrape never reaches the dashboard. A process
that ends by itself (the learner at its last step) calls `await_last_scrape` before `close`, so the run's
last step and last broadcast are scraped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from sparkrl.services.common.settings import MetricsEndpoint
from sparkrl.services.common.thread_server import (
    CONNECTION_TIMEOUT_S,
    BoundedHandler,
    BoundedServer,
    serve,
    stop,
)

log = logging.getLogger("sparkrl.metrics")

Health = Callable[[], dict[str, Any]]  # {"status": "ok" | anything else (503), ...}


class Scrapes:
    """The scrapes of /metrics: how many began, the newest one answered, when the last two began."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.begun, self.answered = 0, 0
        self.times: list[float] = []  # monotonic start times of the last two

    def begin(self) -> int:
        with self._changed:
            self.begun += 1
            self.times = [*self.times[-1:], time.monotonic()]
            return self.begun

    def answer(self, scrape: int) -> None:
        with self._changed:
            self.answered = max(self.answered, scrape)
            self._changed.notify_all()

    def interval(self) -> float | None:
        """Seconds between the last two scrapes (None: fewer than two, nobody is scraping)."""
        with self._changed:
            return self.times[1] - self.times[0] if len(self.times) == 2 else None

    def await_next(self, timeout_s: float) -> bool:
        """Whether a scrape that began after this call was answered within `timeout_s`."""
        with self._changed:
            mark = self.begun
            return self._changed.wait_for(lambda: self.answered > mark, timeout=timeout_s)


class MetricsServer:
    """`start()` binds `endpoint` (no-op when its port is 0); `close()` stops it."""

    endpoint: MetricsEndpoint
    port: int | None  # the bound port once started
    scrapes: Scrapes
    connection_timeout_s: float  # a request's head arrives within it, and no read or write waits longer
    _server: BoundedServer | None

    def __init__(
        self,
        endpoint: MetricsEndpoint,
        registry: CollectorRegistry,
        health: Health,
        connection_timeout_s: float = CONNECTION_TIMEOUT_S,
    ) -> None:
        self.endpoint, self.port, self._server, self.scrapes = endpoint, None, None, Scrapes()
        self.connection_timeout_s = connection_timeout_s
        self._handler = _handler_for(registry, health, self.scrapes)

    def start(self) -> None:
        if self.endpoint.port == 0:
            return
        address = (self.endpoint.host, self.endpoint.port)
        self._server = BoundedServer(address, self._handler, self.connection_timeout_s)
        self.port = self._server.server_address[1]
        serve(self._server, "metrics-http")
        log.info("metrics on http://%s:%d/metrics", self.endpoint.host, self.port)

    def await_last_scrape(self, max_wait_s: float) -> bool:
        """When something scrapes /metrics (two scrapes or more so far), wait for one more: up to twice
        the interval between the last two, at most `max_wait_s`. Returns whether it came."""
        interval = self.scrapes.interval()
        if self._server is None or interval is None or max_wait_s <= 0:
            return False
        wait_s = min(max_wait_s, 2 * interval)
        log.info("waiting up to %.1f s for a last scrape of /metrics (one every %.1f s)", wait_s, interval)
        came = self.scrapes.await_next(wait_s)
        if not came:
            log.info("no scrape of /metrics came in %.1f s: the dashboard may miss the last values", wait_s)
        return came

    def close(self) -> None:
        if self._server is not None:
            stop(self._server)
            self._server = None


def _handler_for(registry: CollectorRegistry, health: Health, scrapes: Scrapes) -> type[BoundedHandler]:
    class Handler(BoundedHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                scrape = scrapes.begin()  # before the values are read: a later change is a later scrape's
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                scrapes.answer(scrape)
            elif path == "/healthz":
                try:
                    report = health()
                except Exception as exc:  # a health probe must answer, whatever broke
                    report = {"status": "error", "detail": f"{type(exc).__name__}: {exc}"}
                code = 200 if report.get("status") == "ok" else 503
                self._send(code, json.dumps(report).encode(), "application/json")
            else:
                self._send(404, b'{"detail": "not found: try /metrics or /healthz"}', "application/json")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    return Handler
