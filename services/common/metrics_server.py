"""A service's own small HTTP endpoint: `GET /metrics` (Prometheus text format) and `GET /healthz`.

For the learner and the rollout workers, whose one loop is busy training or generating: a daemon thread
with its own server, so a scrape never waits for a step. Port 0 means off. Every other path is a 404.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from sparkrl.services.common.settings import MetricsEndpoint
from sparkrl.services.common.thread_server import serve, stop

log = logging.getLogger("sparkrl.metrics")

Health = Callable[[], dict[str, Any]]  # {"status": "ok" | anything else (503), ...}


class MetricsServer:
    """`start()` binds `endpoint` (no-op when its port is 0); `close()` stops it."""

    endpoint: MetricsEndpoint
    port: int | None  # the bound port once started
    _server: ThreadingHTTPServer | None

    def __init__(self, endpoint: MetricsEndpoint, registry: CollectorRegistry, health: Health) -> None:
        self.endpoint, self.port, self._server = endpoint, None, None
        self._handler = _handler_for(registry, health)

    def start(self) -> None:
        if self.endpoint.port == 0:
            return
        self._server = ThreadingHTTPServer((self.endpoint.host, self.endpoint.port), self._handler)
        self.port = self._server.server_address[1]
        serve(self._server, "metrics-http")
        log.info("metrics on http://%s:%d/metrics", self.endpoint.host, self.port)

    def close(self) -> None:
        if self._server is not None:
            stop(self._server)
            self._server = None


def _handler_for(registry: CollectorRegistry, health: Health) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
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
