"""`sparkrl up`'s private Redis, a real redis-server started as the launcher starts it: under a flood of
connections that never authenticate its config (the planned `redis.conf`, client limit lowered so the
flood is small) closes idle clients, so the run's services, waiting as for an outage, get back in; and its
keeper stops it only after the run's other services, so a learner told to stop can still commit."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
from _tmpfs import tmpfs

from sparkrl.plan import REDIS_IDLE_TIMEOUT_S, plan_stack, write_configs
from sparkrl.run_lock import lock_run_dir
from sparkrl.services.common.bus import BusUnavailable, RedisBus
from sparkrl.services.common.settings import SupervisionSettings, load_settings
from sparkrl.supervision import Restarts, on_exit

FLOOD = 64  # the client slots, lowered from the planned 10,000 so the test floods them quickly


def flood_then_reconnect(tmp_path: Path, idle_timeout_s: int, reconnect_max_s: float) -> float:
    """Start the planned Redis (slots and idle timeout scaled down), let a service in, fill every other
    slot with connections that never authenticate, drop the service's connection, and time its next call
    (which must reconnect). Raises what the bus raises when it cannot get back in."""
    plan = plan_stack(load_settings("smoke", [f"run_dir={tmp_path / 'run'}"]), workers=1, private_redis=True)
    write_configs(plan)
    conf = plan.run_dir / "config" / "redis.conf"
    server = subprocess.Popen(
        ["redis-server", str(conf), "--maxclients", str(FLOOD), "--timeout", str(idle_timeout_s)],
        stdout=subprocess.DEVNULL,
    )
    url = plan.settings.bus.url
    admin = redis.Redis.from_url(url, socket_timeout=5)
    flood: list[socket.socket] = []
    try:
        _wait_for(admin)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with RedisBus(plan.settings.bus.model_copy(update={"reconnect_max_s": reconnect_max_s})) as bus:
            bus.set_value("alive", "1")  # the service is in
            while True:  # connections that never say AUTH, until Redis turns new ones away
                conn = socket.create_connection(("127.0.0.1", port), timeout=5)
                conn.sendall(b"PING\r\n")
                answer = conn.recv(200)
                flood.append(conn)
                if b"max number of clients" in answer:
                    break
                assert b"NOAUTH" in answer, answer
                assert len(flood) <= FLOOD + 2, "Redis never refused a connection"
            for client in admin.client_list():  # the service's own connection is gone too (its last: SET)
                if client["cmd"] == "set":
                    admin.client_kill_filter(_id=client["id"])
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))  # and its slot taken
            started = time.monotonic()
            assert bus.get_value("alive") == b"1"
            return time.monotonic() - started
    finally:
        for conn in flood:
            conn.close()
        admin.close()
        server.terminate()
        server.wait(10)


def _wait_for(client: redis.Redis) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)


def test_a_flood_of_unauthenticated_connections_does_not_lock_the_run_out(tmp_path: Path) -> None:
    """With the planned idle timeout (scaled to 2 s) the flood's connections are closed and the service,
    waiting as for an outage, gets back in; without one (Redis's default, 0) it never would."""
    assert f"\ntimeout {REDIS_IDLE_TIMEOUT_S}\n" in str(
        next(s.config for s in plan_stack(load_settings("smoke"), workers=1, private_redis=True).services
             if s.role == "redis")
    )  # fmt: skip
    waited = flood_then_reconnect(tmp_path / "a", idle_timeout_s=2, reconnect_max_s=20)
    assert 1.0 < waited < 15, waited  # it was locked out until the flood's connections were closed
    with pytest.raises(BusUnavailable, match="max number of clients"):
        flood_then_reconnect(tmp_path / "b", idle_timeout_s=0, reconnect_max_s=3)


@pytest.mark.parametrize("line", ["maxmemory-policy noeviction", f"timeout {REDIS_IDLE_TIMEOUT_S}"])
def test_the_planned_redis_conf_says(line: str, tmp_path: Path) -> None:
    plan = plan_stack(load_settings("smoke", [f"run_dir={tmp_path}"]), workers=1, private_redis=True)
    assert f"\n{line}\n" in next(str(s.config) for s in plan.services if s.role == "redis")


def test_the_keeper_stops_redis_only_after_the_runs_other_services(tmp_path: Path) -> None:
    """`sparkrl up` killed: every service gets SIGTERM at once. Redis's keeper takes it and waits while
    another process still holds the run's lock (here a `sleep` standing in for the learner finishing its
    step), so that process can still commit; then it stops Redis and exits with its code."""
    plan = plan_stack(load_settings("smoke", [f"run_dir={tmp_path / 'run'}"]), workers=1, private_redis=True)
    write_configs(plan)
    (spec,) = [s for s in plan.services if s.role == "redis"]
    assert spec.command[1:3] == ("-m", "sparkrl.redis_keeper")
    lock = lock_run_dir(plan.run_dir, "sparkrl up")
    keeper = subprocess.Popen(
        spec.command, pass_fds=(lock.fd,), stdout=subprocess.DEVNULL, start_new_session=True
    )
    learner = subprocess.Popen(["sleep", "60"], pass_fds=(lock.fd,))
    client = redis.Redis.from_url(plan.settings.bus.url, socket_timeout=5)
    try:
        _wait_for(client)
        lock.release()  # as a killed launcher would: only its services hold the run now
        keeper.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert keeper.poll() is None and client.ping()  # still serving the one that is stopping
        learner.kill()
        learner.wait()
        assert keeper.wait(10) == 0  # Redis stopped cleanly once nobody else held the run
        with pytest.raises(redis.ConnectionError):
            client.ping()
    finally:
        for proc in (learner, keeper):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL) if proc is keeper else proc.kill()
        client.close()


def test_a_redis_that_died_on_a_full_disk_is_not_restarted_into_it(tmp_path: Path) -> None:
    """Redis exits when its append-only file cannot grow: restarted into the same full disk it would die
    again (five times, before): the run ends instead, naming the disk and the fix."""
    with tmpfs(tmp_path / "run", "32m") as run_dir:
        plan = plan_stack(load_settings("smoke", [f"run_dir={run_dir}"]), workers=1, private_redis=True)
        write_configs(plan)
        (spec,) = [s for s in plan.services if s.role == "redis"]
        restarts = Restarts(SupervisionSettings())
        assert on_exit(spec, 1, restarts, time.monotonic(), 1).action == "restart"  # room: restarted
        with (run_dir / "filler").open("wb") as file:
            os.posix_fallocate(file.fileno(), 0, shutil.disk_usage(run_dir).free - 4096)
        outcome = on_exit(spec, 1, restarts, time.monotonic(), 1)
        assert (outcome.action, outcome.code) == ("end", 1)
        assert outcome.reason is not None and "is full" in outcome.reason and "--resume" in outcome.reason
