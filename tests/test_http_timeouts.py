"""Connections nobody finishes: every HTTP server of ours closes them (issue 45: 640 threads and
descriptors held by half-open connections in 100 s).

The real servers on loopback ports — a service's /metrics, the learner's weight files, the control
service under uvicorn as `main` configures it — each given a short timeout; clients that connect, send
half a request line and wait (or trickle a byte at a time) are closed by the server, and the process's
threads and descriptors come back down. Times are polled with generous bounds, never asserted tight.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvicorn
from conftest import free_port
from prometheus_client import CollectorRegistry

from sparkrl.services.common import asgi_server
from sparkrl.services.common.metrics_server import MetricsServer
from sparkrl.services.common.settings import BusSettings, ControlSettings, MetricsEndpoint
from sparkrl.services.common.thread_server import BoundedHandler, BoundedServer, serve, stop
from sparkrl.services.common.weight_sync.files import WeightFileServer
from sparkrl.services.control.app import create_app

TIMEOUT_S = 0.5  # the servers' connection timeout here (10 s in a run)
BOUND_S = 20.0  # how long a test waits for anything: far past the timeout, on two shared cores
HALF_OPEN = 40


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _closed_by_server(client: socket.socket) -> bool:
    """Whether the server closed `client`'s connection (an end of stream, or a reset) within BOUND_S."""
    client.settimeout(BOUND_S)
    try:
        while client.recv(4096):  # read past a 408 or 400 some servers answer first
            continue
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _half_open_connections_are_closed(port: int) -> None:
    """HALF_OPEN clients send part of a request line and hold; one trickles a byte every 0.1 s. The server
    closes all of them, and this process's threads and descriptors come back to where they were."""
    threads, fds = threading.active_count(), _fds()
    clients = [socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) for _ in range(HALF_OPEN)]
    for client in clients:
        client.sendall(b"GET /metr")
    trickler = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    trickled = threading.Event()

    def trickle() -> None:
        try:
            for byte in b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 1000:
                trickler.sendall(bytes([byte]))
                time.sleep(0.1)
        except OSError:
            trickled.set()  # the server closed it while it was still sending

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    assert all(_closed_by_server(client) for client in clients)
    sender.join(BOUND_S)
    assert trickled.is_set() or _closed_by_server(trickler), "a head trickled in a byte at a time was held"
    for client in [*clients, trickler]:
        client.close()
    _until(lambda: threading.active_count() <= threads + 1, "the connections' threads to end")
    _until(lambda: _fds() <= fds + 2, "the connections' descriptors to be closed")


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=BOUND_S) as answer:
        return int(answer.status)


def _answers(url: str, status: int) -> bool:
    try:
        return _get(url) == status
    except OSError:  # closed on arrival (the connection's slot not free yet)
        return False


def test_the_metrics_server_closes_connections_nobody_finishes() -> None:
    endpoint = MetricsEndpoint(host="127.0.0.1", port=free_port())
    server = MetricsServer(
        endpoint, CollectorRegistry(), lambda: {"status": "ok"}, connection_timeout_s=TIMEOUT_S
    )
    server.start()
    try:
        assert server.port is not None
        _half_open_connections_are_closed(server.port)
        assert _get(f"http://127.0.0.1:{server.port}/metrics") == 200  # still serving
    finally:
        server.close()


def test_the_weight_file_server_closes_connections_nobody_finishes(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    files = WeightFileServer("127.0.0.1", 0, tmp_path / "model", tmp_path / "snapshot", None, TIMEOUT_S)
    files.start()
    try:
        assert files.port is not None
        _half_open_connections_are_closed(files.port)
        assert _get(f"{files.url}/healthz") == 200
    finally:
        files.close()


def test_connections_over_the_cap_are_closed_on_arrival() -> None:
    class Handler(BoundedHandler):
        def do_GET(self) -> None:
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            """Quiet: the test reads the connections, not the access log."""

    server = BoundedServer(("127.0.0.1", 0), Handler, connection_timeout_s=BOUND_S, max_connections=4)
    serve(server, "capped")
    port = server.server_address[1]
    held = [socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) for _ in range(4)]
    try:
        for client in held:
            client.sendall(b"GET /")
        # The server accepts in order: the four above hold every slot before this one arrives.
        with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as extra:
            extra.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert _closed_by_server(extra) and server.refused_connections >= 1
    finally:
        for client in held:
            client.close()
    _until(lambda: _answers(f"http://127.0.0.1:{port}/", 204), "a slot to come free")
    stop(server)


@pytest.fixture
def control(bus_settings: BusSettings) -> Iterator[int]:
    """The control service, configured as its `main` configures uvicorn, on a loopback port."""
    port = free_port()
    app = create_app(ControlSettings(token="t0ken", port=port), bus_settings)
    config = asgi_server.config(app, "127.0.0.1", port, head_timeout_s=TIMEOUT_S, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _until(lambda: server.started, "uvicorn to start")
    yield port
    server.should_exit = True
    thread.join(BOUND_S)


def test_the_control_service_closes_connections_nobody_finishes(control: int) -> None:
    _half_open_connections_are_closed(control)
    # A keep-alive connection that starts its next request and stops: closed too.
    with socket.create_connection(("127.0.0.1", control), timeout=BOUND_S) as client:
        client.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert client.recv(4096).startswith(b"HTTP/1.1 ")
        client.sendall(b"GET /heal")
        assert _closed_by_server(client)
    assert _get(f"http://127.0.0.1:{control}/api/v1/status") in (200, 503)
