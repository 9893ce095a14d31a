"""A standard-library HTTP server on a thread of its own (every service's /metrics, the learner's weight
files), and its stop. `shutdown` returns once the serving loop looks at its flag: with the loop's default
interval (0.5 s) that added up to a second to each service's exit, which `sparkrl up` waits for.

A connection cannot be held: each one is served by a thread of its own, so a client that connects, sends
part of a request and waits would hold a thread and a descriptor for ever (issue 45: 640 of each in
100 s). `BoundedHandler` gives each request `connection_timeout_s` for its whole head (request line and
headers, however slowly they trickle in), and no later read or write waits longer than that for the peer;
`BoundedServer` closes a connection at once, with no thread, while `max_connections` are open.
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

POLL_S = 0.05  # how often the serving loop looks whether it should stop
CONNECTION_TIMEOUT_S = 10.0  # a request's head arrives within this; no read or write waits longer
MAX_CONNECTIONS = 64  # open at once; more are closed on arrival (a scrape or a download needs a few)

log = logging.getLogger("sparkrl.http")


class BoundedServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer whose connections time out (`BoundedHandler`) and are capped in number."""

    daemon_threads = True
    connection_timeout_s: float
    max_connections: int
    refused_connections: int  # closed on arrival, over the cap
    _slots: threading.BoundedSemaphore

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BoundedHandler],
        connection_timeout_s: float = CONNECTION_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.connection_timeout_s, self.max_connections = connection_timeout_s, max_connections
        self.refused_connections, self._slots = 0, threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused_connections += 1
            if self.refused_connections == 1:
                log.warning("%d connections open: closing new ones until some end", self.max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # the connection's thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class BoundedHandler(BaseHTTPRequestHandler):
    """A request handler whose connection cannot be held open (see the module docstring): the base of
    every handler a `BoundedServer` serves."""

    server: BoundedServer
    _head_deadline: float | None  # monotonic; set while a request's head is being read

    def setup(self) -> None:
        self.timeout = self.server.connection_timeout_s  # StreamRequestHandler: the socket's timeout
        super().setup()
        # The reader makefile() gave holds a reference to the socket: closed, or the socket would stay open.
        self.rfile.close()
        self._head_deadline = None
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, lambda: self._head_deadline))

    def handle_one_request(self) -> None:
        self._head_deadline = time.monotonic() + self.server.connection_timeout_s
        super().handle_one_request()  # a TimeoutError there closes the connection

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # reads the headers
        self._head_deadline = None
        self.connection.settimeout(self.server.connection_timeout_s)
        return parsed


class _DeadlineReader(io.RawIOBase):
    """The connection's bytes; while a request's head is read, no read waits past its deadline, so a
    head sent a byte at a time still ends when the deadline does."""

    def __init__(self, connection: socket.socket, deadline: Callable[[], float | None]) -> None:
        self._connection, self._deadline = connection, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        deadline = self._deadline()
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request's head did not arrive in time")
            self._connection.settimeout(left)
        return self._connection.recv_into(buffer)


def serve(server: ThreadingHTTPServer, name: str) -> None:
    """Serve `server` on a daemon thread named `name` until `stop`."""
    server.daemon_threads = True
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": POLL_S}, name=name, daemon=True
    ).start()


def stop(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()
