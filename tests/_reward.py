"""The reward service as a real subprocess on a loopback port, for the tests that talk to it over HTTP."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import free_port

from sparkrl.services.common.settings import RewardSettings


def process_table() -> dict[int, tuple[int, str]]:
    """pid → (parent pid, state) of every process, read from /proc."""
    table: dict[int, tuple[int, str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        table[int(stat.parent.name)] = (int(fields[1]), fields[0])
    return table


def descendants(pid: int) -> set[int]:
    """Every process below `pid`: the forkserver, the resource tracker and the verifier workers."""
    table = process_table()
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, (parent, _) in table.items() if parent in frontier} - found
        found |= frontier
    return found


def still_running(pids: set[int]) -> set[int]:
    """Those of `pids` alive; a zombie (exited, not yet reaped by whoever adopted it) counts as gone."""
    return {pid for pid, (_, state) in process_table().items() if pid in pids and state != "Z"}


def stop_cleanly(process: subprocess.Popen[bytes], log_path: Path) -> None:
    """SIGTERM, as Docker or Kubernetes would send: the service exits, and so does every pool process."""
    children = descendants(process.pid)
    assert children, "the pool's processes should be the service's descendants"
    process.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal it caught: -SIGTERM is a clean exit.
    assert process.wait(timeout=20) in (0, -signal.SIGTERM), log_path.read_text()
    assert "verifier pool closed" in log_path.read_text()
    deadline = time.monotonic() + 10
    while still_running(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not still_running(children), f"pool processes outlived the service: {still_running(children)}"


def wait_healthy(client: httpx.Client, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"reward service exited with {process.returncode}:\n{log_path.read_text()}")
        with contextlib.suppress(httpx.TransportError):  # not listening yet
            if client.get("/healthz", timeout=1.0).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"reward service not healthy after 60 s:\n{log_path.read_text()}")


@contextlib.contextmanager
def reward_service(log_dir: Path, **overrides: object) -> Iterator[httpx.Client]:
    """The service (2 verifier processes, this folder's `sleep_forever` and `sleep_a_second` verifiers)
    until the block ends; then SIGTERM, and every process it started must be gone."""
    with reward_service_process(log_dir, **overrides) as (client, _):
        yield client


@contextlib.contextmanager
def reward_service_process(log_dir: Path, **overrides: object) -> Iterator[tuple[httpx.Client, int]]:
    """`reward_service`, with the service's pid (to signal it)."""
    port = free_port()
    settings = RewardSettings(
        host="127.0.0.1",
        port=port,
        url=f"http://127.0.0.1:{port}",
        verifier_processes=2,
        # A test module's verifier: the service imports it by path, as it would a user's.
        custom_verifiers=["test_reward_pool:sleep_forever", "test_reward_pool:sleep_a_second"],
        **overrides,
    )
    code = (
        "import sys\n"
        "from sparkrl.services.common.settings import RewardSettings\n"
        "from sparkrl.services.reward.app import main\n"
        "main(RewardSettings.model_validate_json(sys.argv[1]))\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    log_path = log_dir / "service.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", code, settings.model_dump_json()],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    client = httpx.Client(base_url=settings.url, timeout=120.0)
    try:
        wait_healthy(client, process, log_path)
        yield client, process.pid
        stop_cleanly(process, log_path)
    finally:
        client.close()
        if process.poll() is None:
            process.kill()
            process.wait()
