"""Shared fixtures. Tests talk to real services they start themselves: never the Redis on 6379."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from sparkrl.launcher import Stack
from sparkrl.ports import free_ports
from sparkrl.services.common.settings import BusSettings

# ── ports and processes ───────────────────────────────────────────────────────────────────────────────


def clean_env() -> dict[str, str]:
    """This process's environment without SPARKRL_* (a subprocess must see only the settings it is given)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SPARKRL_")}


def free_port() -> int:
    """A loopback port free right now, below the ephemeral range as `sparkrl up` picks them (no client
    connection can take it before its server binds)."""
    return free_ports(1)[0]


class RedisServer:
    """A private `redis-server` on a loopback port; `stop()` and `start()` again keep the same port."""

    port: int
    workdir: Path
    extra_args: tuple[str, ...]
    _proc: subprocess.Popen[bytes] | None

    def __init__(self, workdir: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.extra_args = extra_args
        self._proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not on PATH; run `make test`, which installs it", pytrace=False)
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.workdir), *self.extra_args]
        log_path = self.workdir / f"redis-{self.port}.log"
        with log_path.open("ab") as log_file:
            self._proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
        self._wait_until_ready(timeout_s, log_path)

    def _wait_until_ready(self, timeout_s: float, log_path: Path) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, socket_connect_timeout=1)
        try:
            while time.monotonic() < deadline:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited early:\n{log_path.read_text()[-2000:]}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.02)
            raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout_s} s")
        finally:
            client.close()

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()  # SIGTERM: a clean shutdown, which also flushes an append-only file
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5)
        self._proc = None


def _start_with_retries(workdir: Path, extra_args: tuple[str, ...] = ()) -> RedisServer:
    # The free port can be taken between free_port() and the server's bind: try a few fresh ports.
    last_error: Exception | None = None
    for _ in range(3):
        server = RedisServer(workdir, extra_args)
        try:
            server.start()
            return server
        except RuntimeError as exc:
            server.stop()
            last_error = exc
    raise RuntimeError(f"could not start a private redis-server: {last_error}")


# ── fixtures ──────────────────────────────────────────────────────────────────────────────────────────


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """URL of a private redis-server shared by the session (no persistence, loopback only)."""
    with tempfile.TemporaryDirectory(prefix="sparkrl-redis-") as workdir:
        server = _start_with_retries(Path(workdir))
        try:
            yield server.url
        finally:
            server.stop()


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """The session server's URL, its database emptied before the test, so each test starts clean."""
    client = redis.Redis.from_url(redis_server, socket_timeout=5)
    client.flushdb()
    client.close()
    yield redis_server


@pytest.fixture
def bus_settings(redis_url: str) -> BusSettings:
    """Bus settings on the private server, with timings small enough for tests (`model_copy` to adjust)."""
    return BusSettings(
        url=redis_url,
        namespace=f"test-{uuid.uuid4().hex[:8]}",
        block_ms=50,
        claim_idle_ms=200,
        socket_timeout_s=2.0,
        reconnect_max_s=2.0,
    )


@pytest.fixture
def spawn_redis(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start extra private redis-servers a test may stop and restart; all are stopped afterwards."""
    servers: list[RedisServer] = []

    def spawn(*extra_args: str) -> RedisServer:
        server = _start_with_retries(tmp_path, tuple(extra_args))
        servers.append(server)
        return server

    yield spawn
    for server in servers:
        server.stop()


@pytest.fixture
def stacks() -> Iterator[list[Stack]]:
    """Stacks a test starts (`start_stack`); all shut down at the end, whatever happened."""
    started: list[Stack] = []
    yield started
    for stack in reversed(started):
        stack.shutdown()


def start_stack(stacks: list[Stack], stack: Stack) -> Stack:
    """Start `stack`, kept in the `stacks` fixture's list so it is shut down after the test."""
    stacks.append(stack)
    stack.start()
    return stack
