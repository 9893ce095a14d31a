"""The Redis bus's settings: the `bus` section; re-exported by `settings.py`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sparkrl.services.common.settings.section import Section


class BusSettings(Section):
    """Redis Streams that carry prompts, trajectory groups and dead letters."""

    url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL shared by every service.")
    host: str = Field(
        "127.0.0.1",
        description="Interface `sparkrl up`'s private Redis binds, and the host its bus.url names: an "
        "address of this machine the workers' nodes reach when they run elsewhere (`--ray` on a "
        "cluster). Unused with a bus.url of your own.",
    )
    namespace: str = Field(
        "sparkrl", min_length=1, description="Prefix of every key, so runs can share a Redis."
    )
    prompt_maxlen: int = Field(
        100_000, ge=16, description="Cap on unread prompts; the feeder waits (back-pressure) when it is full."
    )
    trajectory_maxlen: int = Field(
        512, ge=4, description="Cap on unread trajectory groups; rollout workers wait when the learner lags."
    )
    dead_letter_maxlen: int = Field(10_000, ge=16, description="Dead-letter stream length (oldest trimmed).")
    telemetry_maxlen: int = Field(
        20_000,
        ge=100,
        description="Entries kept in each telemetry stream (step rows, sync history, events, control "
        "commands); the oldest are trimmed.",
    )
    block_ms: int = Field(1000, ge=10, le=60_000, description="Longest a blocking read waits, milliseconds.")
    claim_idle_ms: int = Field(
        30_000, ge=100, description="A delivered entry idle this long is reclaimed from its (dead) consumer."
    )
    max_deliveries: int = Field(
        5, ge=1, description="An entry delivered this many times without ack goes to the dead-letter stream."
    )
    publish_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long a rollout worker waits on a full trajectory stream before failing, seconds "
        "(the prompt feeder waits on a full prompt stream as long as it takes).",
    )
    dedup_ttl_s: float = Field(
        7 * 24 * 3600.0, gt=0, description="How long a published prompt/group id is remembered, seconds."
    )
    aof_fsync: Literal["always", "everysec"] = Field(
        "always",
        description="The private Redis of `sparkrl up`: when its append-only file is fsynced. `always`: "
        "nothing acknowledged is ever lost, a killed Redis or a power loss; `everysec`: an fsync a "
        "second (Redis may hold writes back up to 2 s while the disk is slow, which a crash then loses). "
        "Measured on the demo: no difference in speed.",
    )
    redis_max_memory_mb: int | None = Field(
        None,
        ge=64,
        description="The private Redis of `sparkrl up`: its `maxmemory`, MiB. Past it Redis refuses "
        "writes and evicts nothing (an evicted trained mark would train a group twice); the services wait "
        "as for an outage (bus.reconnect_max_s), naming it. None: twice what the streams' bounds hold "
        "(prompt_maxlen, trajectory_maxlen, dead_letter_maxlen, telemetry_maxlen at the rollout's group "
        "size), 1 GiB at least.",
    )
    socket_timeout_s: float = Field(10.0, gt=0, description="Timeout of every Redis call, seconds.")
    reconnect_max_s: float = Field(
        60.0,
        gt=0,
        description="Give up reconnecting, or waiting for a Redis that refuses writes (out of memory, a "
        "disk it cannot write, a read-only replica), after this long, seconds.",
    )
    run_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="This run's identity on the bus. Its learner owns the namespace under it (a lease, "
        "renewed while it runs): a learner of another run is refused while the lease lives, and workers "
        "and feeders given a run id refuse a namespace another run owns. `sparkrl up` sets it (kept in "
        "RUN_DIR/run-id, so `--resume` is the same run); None: the learner takes RUN_DIR/run-id, made "
        "on a fresh start, and the others check nothing.",
    )
    owner_ttl_s: float = Field(
        15.0,
        ge=2,
        le=600,
        description="How long the namespace stays owned after its learner last renewed its lease, "
        "seconds (renewed every third of it): how long another run is refused after a learner died "
        "without a word. A learner of the same run takes over at once.",
    )
