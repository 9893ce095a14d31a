"""One owner per run, and a Redis that refuses writes, against real redis-servers: the namespace lease
(claimed, renewed, taken over by the same run, refused to another), the run directory's fence, and the
bus riding out `maxmemory` the way it rides out an outage."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from conftest import RedisServer

from sparkrl.proto.run_files import RunOwner
from sparkrl.services.common.bus import BusUnavailable, RedisBus
from sparkrl.services.common.ownership import (
    FENCE_FILE,
    Fence,
    Fenced,
    Lease,
    NamespaceOwned,
    foreign_owner,
    run_id_of,
)
from sparkrl.services.common.settings import BusSettings


def test_a_run_id_is_made_once_and_kept_by_a_resume(tmp_path: Path) -> None:
    first = run_id_of(tmp_path, fresh=True)
    assert run_id_of(tmp_path, fresh=False) == first
    assert (tmp_path / "run-id").stat().st_mode & 0o777 == 0o600
    assert run_id_of(tmp_path, fresh=True) != first  # a fresh run in the directory is another run


def test_another_run_is_refused_naming_the_owner_and_the_same_run_takes_over(
    bus_settings: BusSettings, tmp_path: Path
) -> None:
    stop_a, stop_b = threading.Event(), threading.Event()
    with RedisBus(bus_settings) as bus:
        a = Lease.claim(bus, "run-a", tmp_path / "a", stop_a)
        assert a.owner.generation == 1 and a.owner.run_id == "run-a"
        with pytest.raises(NamespaceOwned) as refused:
            Lease.claim(bus, "run-b", tmp_path / "b", stop_b)
        said = str(refused.value)
        assert "run run-a" in said and str(tmp_path / "a") in said and "bus.namespace" in said
        assert not (tmp_path / "b" / FENCE_FILE).exists()  # nothing written for the refused run
        assert foreign_owner(bus, "run-b") is not None and foreign_owner(bus, "run-a") is None
        # The same run again (a restarted learner): taken over at once, under a new generation, and the
        # directory's fence now names the new one, so the earlier learner may write nothing.
        again = Lease.claim(bus, "run-a", tmp_path / "a", stop_a)
        assert again.owner.generation == 2
        with pytest.raises(Fenced, match="generation 1"):
            Fence(tmp_path / "a", a.owner).check("a checkpoint")
        Fence(tmp_path / "a", again.owner).check("a checkpoint")
        again.release()
        assert bus.owners.current() is None
        Lease.claim(bus, "run-b", tmp_path / "b", stop_b).release()  # free once released


def test_a_lease_expires_unless_renewed_and_a_taken_lease_stops_its_learner(
    bus_settings: BusSettings, tmp_path: Path
) -> None:
    settings = bus_settings.model_copy(update={"owner_ttl_s": 2.0})
    stop = threading.Event()
    with RedisBus(settings) as bus:
        lease = Lease.claim(bus, "run-a", tmp_path, stop)
        lease.start()
        time.sleep(3.0)  # past one ttl: renewed meanwhile
        with pytest.raises(NamespaceOwned):
            Lease.claim(bus, "run-b", tmp_path / "b", threading.Event())
        # Someone deletes the lease and another run claims the namespace: the holder learns at its next
        # renewal, says who took it and sets its stop.
        redis.Redis.from_url(settings.url).delete(f"{settings.namespace}:value:owner")
        Lease.claim(bus, "run-b", tmp_path / "b", threading.Event())
        assert stop.wait(5.0)
        assert lease.lost is not None and "run run-b" in lease.lost
        lease.join(2.0)


def test_an_unrenewed_lease_frees_the_namespace(bus_settings: BusSettings, tmp_path: Path) -> None:
    settings = bus_settings.model_copy(update={"owner_ttl_s": 2.0})
    with RedisBus(settings) as bus:
        Lease.claim(bus, "run-a", tmp_path, threading.Event())  # never started: a learner that died
        time.sleep(2.2)
        Lease.claim(bus, "run-b", tmp_path / "b", threading.Event())


def test_a_hand_written_owner_record_is_never_overwritten(bus_settings: BusSettings, tmp_path: Path) -> None:
    with RedisBus(bus_settings) as bus:
        redis.Redis.from_url(bus_settings.url).set(f"{bus_settings.namespace}:value:owner", "not json")
        with pytest.raises(NamespaceOwned, match="cannot read"):
            Lease.claim(bus, "run-a", tmp_path, threading.Event())


def test_the_fence_file_is_the_owner_record(tmp_path: Path) -> None:
    owner = RunOwner(run_id="r", generation=3, run_dir=str(tmp_path), host="h", pid=1, since=0.0)
    (tmp_path / FENCE_FILE).write_text(owner.model_dump_json())
    Fence(tmp_path, owner).check("x")
    (tmp_path / FENCE_FILE).unlink()
    with pytest.raises(Fenced, match=r"no readable owner\.json"):
        Fence(tmp_path, owner).check("x")


def test_writes_refused_for_maxmemory_are_ridden_out_then_given_up(
    spawn_redis: Callable[..., RedisServer],
) -> None:
    """`CONFIG SET maxmemory` below what Redis uses turns every write into OOM: the bus waits (a warning
    naming it) and goes on once writes are allowed again; past `bus.reconnect_max_s` it gives up saying
    the writes were refused. Nothing was half-written."""
    server = spawn_redis()
    raw = redis.Redis.from_url(server.url)
    settings = BusSettings(
        url=server.url, namespace="oom", block_ms=50, socket_timeout_s=2.0, reconnect_max_s=6
    )
    with RedisBus(settings) as bus:
        assert bus.publish_group("g-0", b"x" * 10_000)
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", 1)  # everything is over it now: writes refused, reads answered

        def allow_later() -> None:
            time.sleep(1.5)
            raw.config_set("maxmemory", 0)

        threading.Thread(target=allow_later, daemon=True).start()
        started = time.monotonic()
        assert bus.publish_group("g-1", b"y")  # waited for the writes, then added
        assert time.monotonic() - started >= 1.0
        assert bus.reconnect.trouble is None  # over: the status no longer names it
        raw.config_set("maxmemory", 1)
        with pytest.raises(BusUnavailable, match=r"refused writes .*bus\.reconnect_max_s=6.*OOM"):
            bus.set_values({"mark": "1"})
        assert bus.reconnect.trouble is not None and "refuses writes" in bus.reconnect.trouble
        raw.config_set("maxmemory", 0)
        assert bus.pending_info("trajectories").lag == 2 and raw.get("oom:value:mark") is None
    raw.close()


def test_up_gives_every_service_the_run_id_a_resume_keeps_and_its_redis_evicts_nothing(
    tmp_path: Path,
) -> None:
    from sparkrl.plan import plan_stack, redis_max_memory, write_configs
    from sparkrl.services.common.settings import load_settings

    cfg = load_settings("smoke", [f"run_dir={tmp_path / 'run'}"])
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    run_id = plan.settings.bus.run_id
    assert run_id and (tmp_path / "run" / "run-id").read_text().strip() == run_id
    configs = [spec.config for spec in plan.services if hasattr(spec.config, "bus")]
    assert len(configs) >= 5 and {c.bus.run_id for c in configs} == {run_id}  # type: ignore[union-attr]
    (conf,) = [spec.config for spec in plan.services if spec.role == "redis"]
    sized = redis_max_memory(plan.settings)
    assert sized >= 2**30 and f"\nmaxmemory {sized}\nmaxmemory-policy noeviction\n" in conf  # type: ignore[operator]
    assert plan_stack(cfg, workers=1, private_redis=True, resume=True).settings.bus.run_id == run_id
    assert plan_stack(cfg, workers=1, private_redis=True).settings.bus.run_id != run_id  # a fresh run
    sized = plan_stack(load_settings("smoke", [f"run_dir={tmp_path}", "bus.redis_max_memory_mb=300"]), 1)
    assert f"\nmaxmemory {300 * 2**20}\n" in next(s.config for s in sized.services if s.role == "redis")  # type: ignore[operator]


def test_a_redis_that_lost_its_data_gives_the_lease_back_to_its_holder(
    bus_settings: BusSettings, tmp_path: Path
) -> None:
    """A Redis restarted empty (no persistence) forgets the lease and its count: the holder's next renewal
    takes both back, so another run cannot claim the namespace under a generation the holder had."""
    with RedisBus(bus_settings) as bus:
        Lease.claim(bus, "run-a", tmp_path, threading.Event()).release()
        lease = Lease.claim(bus, "run-a", tmp_path, threading.Event())
        assert lease.owner.generation == 2
        redis.Redis.from_url(bus_settings.url).flushdb()
        assert bus.owners.renew(lease.record, lease.owner.generation, 5.0).held
        with pytest.raises(NamespaceOwned):
            Lease.claim(bus, "run-b", tmp_path / "b", threading.Event())
        assert Lease.claim(bus, "run-a", tmp_path, threading.Event()).owner.generation == 3


def test_a_runs_consumer_groups_carry_its_id(bus_settings: BusSettings) -> None:
    """A run's consumer groups are named for it (`XINFO GROUPS` says whose they are): a process of another
    run, were it not refused by the owner lease, reads through its own group and never claims or holds
    entries of this run's group (its pending list, what its workers reclaim)."""
    mine = bus_settings.model_copy(update={"run_id": "run-a"})
    other = bus_settings.model_copy(update={"run_id": "run-b"})
    with RedisBus(mine) as bus, RedisBus(other) as stranger:
        assert bus.groups == {"prompts": "rollout@run-a", "trajectories": "learner@run-a"}
        assert RedisBus(bus_settings).groups == {"prompts": "rollout", "trajectories": "learner"}
        bus.publish_prompt("p-1", b"x")
        assert [e.item_id for e in bus.read("prompts", "w", 10)] == ["p-1"]
        assert bus.pending_info("prompts").pending == 1
        assert [e.item_id for e in stranger.read("prompts", "w", 10)] == ["p-1"]  # its own group's view
        assert bus.pending_info("prompts").pending == 1  # ours untouched by the stranger's read


def test_a_feeder_of_another_run_is_refused(bus_settings: BusSettings, tmp_path: Path) -> None:
    import subprocess
    import sys

    from conftest import clean_env

    with RedisBus(bus_settings) as bus:
        Lease.claim(bus, "run-a", tmp_path, threading.Event())
        given = [f"bus.url={bus_settings.url}", f"bus.namespace={bus_settings.namespace}", "bus.run_id=run-b"]
        fed = subprocess.run(
            [sys.executable, "-m", "sparkrl.cli", "prompts", "--preset", "smoke",
             *(arg for setting in [*given, "prompts.count=4"] for arg in ("--set", setting))],
            capture_output=True, text=True, timeout=120, env=clean_env(),
        )  # fmt: skip
        assert fed.returncode == 2, fed.stdout + fed.stderr
        assert "the feeder of run run-b refused" in fed.stderr and "is owned by run run-a" in fed.stderr
        assert bus.pending_info("prompts").lag == 0  # nothing fed
