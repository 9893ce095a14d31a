"""A standard-library HTTP server on a thread of its own (every service's /metrics, the learner's weight
files), and its stop. `shutdown` returns once the serving loop looks at its flag: with the loop's default
interval (0.5 s) that added up to a second to each service's exit, which `sparkrl up` waits for."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer

POLL_S = 0.05  # how often the serving loop looks whether it should stop


def serve(server: ThreadingHTTPServer, name: str) -> None:
    """Serve `server` on a daemon thread named `name` until `stop`."""
    server.daemon_threads = True
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": POLL_S}, name=name, daemon=True
    ).start()


def stop(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()
