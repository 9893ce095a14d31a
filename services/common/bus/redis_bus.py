"""`RedisBus`: both sides of the bus over Redis Streams (see the package docstring for the guarantees)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from sparkrl.services.common.bus._text import is_missing_group, mask_password, text
from sparkrl.services.common.bus.logs import LogStreams
from sparkrl.services.common.bus.lua import (
    DEAD_LETTER_LUA,
    PUBLISH_LUA,
    REFUSED_LUA,
    REQUEUE_LUA,
    SEND_BACK_LUA,
)
from sparkrl.services.common.bus.owner import Owners
from sparkrl.services.common.bus.reads import Reader
from sparkrl.services.common.bus.reconnect import Reconnect, refused_write
from sparkrl.services.common.bus.records import (
    GROUPS,
    BusBackpressureTimeout,
    DeadLetter,
    Entry,
    QueueDepth,
    StreamKind,
)
from sparkrl.services.common.bus.statuses import Statuses
from sparkrl.services.common.bus.values import NamedValues
from sparkrl.services.common.settings import BusSettings

log = logging.getLogger("sparkrl.bus")

T = TypeVar("T")
_Row = tuple[bytes, dict[bytes, bytes], int]  # (entry id, fields, deliveries including this one)

_POLL_MAX_S = 0.02  # longest sleep between back-pressure checks


class RedisBus:
    """Both sides of the bus. Thread-safe like a redis-py client (one connection per call, pooled)."""

    settings: BusSettings
    url: str  # the URL with any password masked, for messages
    dedup_ttl_s: float  # how long a published id is remembered
    logs: LogStreams  # capped logs: telemetry and the control stream
    status_board: Statuses  # members' heartbeats
    values: NamedValues  # named values: announcement, control state, marks
    owners: Owners  # the lease of the run that owns the namespace
    _redis: redis.Redis
    _reader: Reader  # new entries, a large read over several connections
    groups: dict[str, str]  # stream kind → its consumer group: the role's, with the run's id when it has one
    _groups_ready: set[str]
    reconnect: Reconnect  # how a lost connection is retried, and for how long
    _publish_script: Script
    _dead_letter_script: Script
    _requeue_script: Script
    _send_back_script: Script
    _refused_script: Script

    def __init__(
        self,
        settings: BusSettings,
        stop: threading.Event | None = None,
        reconnect_setting: str = "bus.reconnect_max_s",
    ) -> None:
        """`stop`: the service's stop event; once it is set, a lost connection is retried for at most
        `STOPPING_RECONNECT_S`, then the call raises `BusStopping`. `reconnect_setting`: the setting that
        `settings.reconnect_max_s` came from, named when reconnecting gives up."""
        if settings.block_ms >= settings.socket_timeout_s * 1000:
            raise ValueError(
                f"bus.block_ms ({settings.block_ms}) must be below bus.socket_timeout_s "
                f"({settings.socket_timeout_s} s), or every idle blocking read would time out"
            )
        self.settings = settings
        self.url = mask_password(settings.url)
        self.dedup_ttl_s = settings.dedup_ttl_s
        # redis-py's own retries are off: `_run` owns retrying, so its backoff and deadline are the only ones.
        self._redis = redis.Redis.from_url(
            settings.url,
            socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=settings.socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._reader = Reader(self._redis)
        # A run's consumer groups are named for it: a process of another run (which the owner lease refuses)
        # cannot join them, claim their pending entries or reclaim from their consumers.
        suffix = f"@{settings.run_id}" if settings.run_id else ""
        self.groups = {kind: group + suffix for kind, group in GROUPS.items()}
        self._groups_ready = set()
        self.reconnect = Reconnect(self.url, settings.reconnect_max_s, reconnect_setting, stop)
        self._publish_script = self._redis.register_script(PUBLISH_LUA)
        self._dead_letter_script = self._redis.register_script(DEAD_LETTER_LUA)
        self._requeue_script = self._redis.register_script(REQUEUE_LUA)
        self._send_back_script = self._redis.register_script(SEND_BACK_LUA)
        self._refused_script = self._redis.register_script(REFUSED_LUA)
        self.logs = LogStreams(self._redis, self._run, settings.namespace, settings.telemetry_maxlen)
        self.status_board = Statuses(self._redis, self._run, settings.namespace)
        self.values = NamedValues(self._redis, self._run, settings.namespace)
        self.owners = Owners(self._redis, self._run, settings.namespace)

    def close(self) -> None:
        self._reader.close()
        self._redis.close()

    def __enter__(self) -> RedisBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ── keys ──────────────────────────────────────────────────────────────────────────────────────────
    def stream_key(self, kind: str) -> str:
        """`{ns}:prompts`, `{ns}:trajectories`, `{ns}:dead`."""
        return f"{self.settings.namespace}:{kind}"

    def _published_key(self, kind: StreamKind, item_id: str) -> str:
        return f"{self.settings.namespace}:published:{kind}:{item_id}"

    def _maxlen(self, kind: StreamKind) -> int:
        return self.settings.prompt_maxlen if kind == "prompts" else self.settings.trajectory_maxlen

    # ── producer side ─────────────────────────────────────────────────────────────────────────────────
    def publish_prompt(
        self, prompt_id: str, payload: bytes, timeout_s: float | None = None, poll_max_s: float = 0.02
    ) -> bool:
        """Add a prompt unless this prompt id was published before; False for a duplicate. While the
        stream is full it looks again at most every `poll_max_s`."""
        return self._publish("prompts", prompt_id, payload, timeout_s, poll_max_s)

    def publish_group(self, group_id: str, payload: bytes, timeout_s: float | None = None) -> bool:
        """Add a trajectory group unless this group id was published before; False for a duplicate."""
        return self._publish("trajectories", group_id, payload, timeout_s)

    def publish_groups_once(self, groups: list[tuple[str, bytes]]) -> list[bool | None]:
        """Try to add each (group id, payload) in one round trip, in order, each add atomic as in
        `publish_group`, none waiting: per group True (added), False (published before: a duplicate) or
        None (the stream was full; publish it with `publish_group`, which waits)."""
        if not groups:
            return []
        kind: StreamKind = "trajectories"
        key, maxlen, ttl_ms = self.stream_key(kind), self._maxlen(kind), int(self.dedup_ttl_s * 1000)

        def publish_all() -> list[object]:
            pipe = self._redis.pipeline(transaction=False)
            for group_id, payload in groups:
                keys = [self._published_key(kind, group_id), key]
                self._publish_script(keys=keys, args=[ttl_ms, maxlen, group_id, payload], client=pipe)
            return pipe.execute()

        # A retry after a lost reply finds the groups added before it as duplicates: none is doubled.
        return [None if result == -1 else result != 0 for result in self._run(publish_all, kind)]

    def _publish(
        self,
        kind: StreamKind,
        item_id: str,
        payload: bytes,
        timeout_s: float | None,
        poll_max_s: float = _POLL_MAX_S,
    ) -> bool:
        """Wait while the stream is full (bounded polls, up to timeout_s), then add atomically.

        A reply lost to a dropped connection is retried; the retry then finds the id already published
        and returns False, but the entry is in the stream: nothing is lost or doubled.
        """
        timeout_s = self.settings.publish_timeout_s if timeout_s is None else timeout_s
        key, maxlen = self.stream_key(kind), self._maxlen(kind)
        keys = [self._published_key(kind, item_id), key]
        args = [int(self.dedup_ttl_s * 1000), maxlen, item_id, payload]
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            result = self._run(lambda: self._publish_script(keys=keys, args=args), kind)
            if result != -1:
                return result != 0
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BusBackpressureTimeout(
                    f"{key} held {maxlen} unread or pending entries for {timeout_s:.1f} s; "
                    f"is consumer group {self.groups[kind]!r} running and acknowledging?"
                )
            log.debug("%s is full (%d entries): waiting for group %r", key, maxlen, self.groups[kind])
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, poll_max_s)

    # ── consumer side ─────────────────────────────────────────────────────────────────────────────────
    def read(self, kind: StreamKind, consumer: str, count: int, block_ms: int | None = None) -> list[Entry]:
        """Up to `count` entries: first ones reclaimed from dead consumers, then new ones.

        Blocks up to block_ms (default settings.block_ms; 0: not at all) only when nothing was reclaimed.
        An entry delivered more than max_deliveries times is dead-lettered here, not returned.
        """
        if count < 1:
            raise ValueError(f"count must be ≥ 1, got {count}")
        block = self._block_ms(block_ms)
        rows = self._run(lambda: self._reclaim(kind, consumer, count), kind)
        entries = self._screen(kind, rows)
        if len(entries) < count:
            # Reclaimed work should start now, so only an empty hand waits for new entries.
            wait = None if entries or block == 0 else block
            fresh = self._run(lambda: self._read_new(kind, consumer, count - len(entries), wait), kind)
            entries.extend(self._screen(kind, fresh))
        return entries

    def read_decoded(
        self,
        kind: StreamKind,
        consumer: str,
        count: int,
        decode: Callable[[bytes], T],
        block_ms: int | None = None,
    ) -> list[tuple[Entry, T]]:
        """`read`, then decode each payload; one that fails to decode is dead-lettered with the error."""
        decoded: list[tuple[Entry, T]] = []
        for entry in self.read(kind, consumer, count, block_ms):
            try:
                value = decode(entry.payload)
            except Exception as exc:  # any decoder failure means a malformed message, not a bus fault
                self.dead_letter(kind, entry, str(exc) or type(exc).__name__)
                continue
            decoded.append((entry, value))
        return decoded

    def ack(self, kind: StreamKind, entry_ids: list[str]) -> int:
        """Acknowledge and delete (one transaction); returns how many were still pending."""
        if not entry_ids:
            return 0
        key, group = self.stream_key(kind), self.groups[kind]

        def ack_and_delete() -> int:
            pipe = self._redis.pipeline(transaction=True)
            pipe.xack(key, group, *entry_ids)
            pipe.xdel(key, *entry_ids)
            acked, _ = pipe.execute()
            return int(acked)

        return self._run(ack_and_delete, kind)

    def touch(self, kind: StreamKind, consumer: str, entry_ids: list[str]) -> int:
        """Reset the idle time of entries `consumer` still works on, so nobody (itself included) reclaims
        them; for a consumer that holds entries longer than claim_idle_ms. Returns how many were pending.
        """
        if not entry_ids:
            return 0
        key, group = self.stream_key(kind), self.groups[kind]

        # JUSTID: a keep-alive is not a delivery, so it leaves the delivery count alone.
        def keep_alive() -> list[bytes]:
            return self._redis.xclaim(key, group, consumer, 0, entry_ids, justid=True)

        return len(self._run(keep_alive, kind))

    def release(self, kind: StreamKind, consumer: str, entry_ids: list[str]) -> int:
        """Hand entries `consumer` holds back at once: their idle time is set past claim_idle_ms, so the
        next read of any consumer reclaims them (a worker that stops mid-generation, its partial work
        saved). Not a delivery: the count is unchanged. Returns how many were pending."""
        if not entry_ids:
            return 0
        key, group, idle = self.stream_key(kind), self.groups[kind], 10 * self.settings.claim_idle_ms + 1000

        def set_idle() -> list[bytes]:
            return self._redis.xclaim(key, group, consumer, 0, entry_ids, idle=idle, justid=True)

        return len(self._run(set_idle, kind))

    def dead_letter(self, kind: StreamKind, entry: Entry, reason: str) -> bool:
        """Move an entry to `{ns}:dead` with its reason, ack and delete it (atomic); False if not pending."""
        log.warning("dead-lettering %s entry %s (%s): %s", kind, entry.entry_id, entry.item_id, reason)
        keys = [self.stream_key(kind), self.stream_key("dead")]
        args = [
            self.groups[kind],
            entry.entry_id,
            self.settings.dead_letter_maxlen,
            entry.item_id,
            reason,
            entry.payload,
            int(time.time() * 1000),
            entry.deliveries,
        ]
        return self._run(lambda: self._dead_letter_script(keys=keys, args=args), kind) == 1

    def dead_letter_refused(self, kind: StreamKind, item_id: str, reason: str) -> bool:
        """Record in `{ns}:dead` an item a producer refused to publish (a prompt over the limits), with its
        reason and without its payload; once per id (False: published or refused before)."""
        keys = [self._published_key(kind, item_id), self.stream_key("dead")]
        args = [self.settings.dead_letter_maxlen, self.stream_key(kind), item_id, reason]
        args += [int(time.time() * 1000), int(self.dedup_ttl_s * 1000)]
        return self._run(lambda: self._refused_script(keys=keys, args=args)) == 1

    def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        """The newest `count` dead letters, newest first."""
        rows = self._run(lambda: self._redis.xrevrange(self.stream_key("dead"), count=count))
        return [DeadLetter.from_fields(fields, text(record_id)) for record_id, fields in rows]

    def requeue_dead_letter(self, record_id: str) -> str | None:
        """Put a dead letter back into its stream (a new entry, delivered afresh); its new entry id, or None
        when no dead letter has that id."""
        keys, args = [self.stream_key("dead")], [record_id]
        new_id = self._run(lambda: self._requeue_script(keys=keys, args=args))
        return text(new_id) if new_id else None

    def send_back(self, entry: Entry, prompt_id: str, prompt: bytes) -> bool:
        """Drop a trajectory group and feed its prompt again, atomically, so it is made again: both ids
        are forgotten by the dedup (the new group keeps the old id). False when it was not pending."""
        group_mark = self._published_key("trajectories", entry.item_id)
        keys = [self.stream_key("trajectories"), self.stream_key("prompts"), group_mark]
        keys.append(self._published_key("prompts", prompt_id))
        args = [self.groups["trajectories"], entry.entry_id, prompt_id, prompt, int(self.dedup_ttl_s * 1000)]
        return self._run(lambda: self._send_back_script(keys=keys, args=args), "trajectories") == 1

    def persistence(self) -> str | None:
        """`aof`, `snapshots only`, `nothing`; None when Redis will not say (CONFIG is often locked down)."""
        try:
            config = self._run(lambda: self._redis.config_get("appendonly") | self._redis.config_get("save"))
        except ResponseError:
            return None
        if text(config.get("appendonly", "")) == "yes":
            return "aof"
        return "snapshots only" if text(config.get("save", "")).strip() else "nothing"

    def dead_letter_count(self) -> int:
        return int(self._run(lambda: self._redis.xlen(self.stream_key("dead"))))

    def pending_info(self, kind: StreamKind) -> QueueDepth:
        """(lag, pending) of the stream's consumer group."""
        key, group = self.stream_key(kind), self.groups[kind]

        def query() -> QueueDepth:
            pipe = self._redis.pipeline(transaction=True)
            pipe.xinfo_groups(key)
            pipe.xlen(key)
            groups, length = pipe.execute()
            info = next((g for g in groups if text(g["name"]) == group), None)
            if info is None:
                return QueueDepth(lag=int(length), pending=0)
            pending = int(info["pending"])
            # Redis reports lag as nil after some deletions; since acked entries are deleted, the stream
            # holds exactly the undelivered plus the pending ones, so the difference is the same number.
            lag = info.get("lag")
            return QueueDepth(lag=int(length) - pending if lag is None else int(lag), pending=pending)

        return self._run(query, kind)

    def _reclaim(self, kind: StreamKind, consumer: str, count: int) -> list[_Row]:
        """XAUTOCLAIM entries idle > claim_idle_ms from any consumer, this one included."""
        key, group = self.stream_key(kind), self.groups[kind]
        claimed: list[tuple[bytes, dict[bytes, bytes]]] = []
        cursor: bytes | str = "0-0"
        # Walk the whole pending list (it holds only in-flight entries, so it is short): a busy head must
        # not hide idle entries behind it.
        while len(claimed) < count:
            reply = self._redis.xautoclaim(
                key, group, consumer, self.settings.claim_idle_ms, start_id=cursor, count=count - len(claimed)
            )
            cursor = reply[0]
            claimed.extend((entry_id, fields) for entry_id, fields in reply[1] if fields is not None)
            if text(cursor) == "0-0":
                break
        if not claimed:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for entry_id, _ in claimed:
            pipe.xpending_range(key, group, min=entry_id, max=entry_id, count=1)
        rows = []
        for (entry_id, fields), pending in zip(claimed, pipe.execute(), strict=True):
            if pending:  # empty: acknowledged by its slow owner since the claim; nothing left to do
                rows.append((entry_id, fields, int(pending[0]["times_delivered"])))
        return rows

    def _read_new(self, kind: StreamKind, consumer: str, count: int, block_ms: int | None) -> list[_Row]:
        rows = self._reader.read_new(self.groups[kind], consumer, self.stream_key(kind), count, block_ms)
        return [(entry_id, fields, 1) for entry_id, fields in rows]

    def _screen(self, kind: StreamKind, rows: list[_Row]) -> list[Entry]:
        """Rows → entries; dead-letter the over-delivered and the malformed instead of returning them."""
        entries = []
        for entry_id, fields, deliveries in rows:
            entry = Entry(
                entry_id=text(entry_id),
                item_id=text(fields.get(b"id", b"")),
                payload=fields.get(b"payload", b""),
                deliveries=deliveries,
            )
            if b"payload" not in fields or b"id" not in fields:
                self.dead_letter(kind, entry, f"entry lacks the 'id' or 'payload' field: {sorted(fields)}")
            elif deliveries > self.settings.max_deliveries:
                self.dead_letter(kind, entry, f"delivered {deliveries - 1} times without ack")
            else:
                entries.append(entry)
        return entries

    # ── status, presence, announcements ───────────────────────────────────────────────────────────────
    def put_status(self, kind: str, member_id: str, payload_json: str, ttl_s: float) -> None:
        """Publish a member's status; it vanishes ttl_s after the last put, so a dead member disappears."""
        self.status_board.put(kind, member_id, payload_json, ttl_s)

    def statuses(self, kind: str) -> dict[str, str]:
        """member id → status JSON of every live member of `kind` (one round trip)."""
        return self.status_board.live(kind)

    def status(self, kind: str, member_id: str) -> str | None:
        """One member's status JSON, None when it is not live."""
        return self.status_board.get(kind, member_id)

    def set_value(
        self, name: str, payload: str | bytes, ttl_s: float | None = None, only_if_absent: bool = False
    ) -> bool:
        """A named value (weight-sync announcement, control state); ttl_s None keeps it. With
        `only_if_absent` an existing value wins; returns whether this one was written."""
        return self.values.set(name, payload, ttl_s, only_if_absent)

    def set_values(self, values: dict[str, str], ttl_s: float | None = None) -> None:
        """Many named values in one pipelined round trip per thousand."""
        self.values.set_many(values, ttl_s)

    def get_value(self, name: str) -> bytes | None:
        return self.values.get(name)

    def delete_values(self, names: list[str]) -> int:
        """Remove named values; how many there were."""
        return self.values.delete_many(names)

    def get_values(self, names: list[str]) -> list[bytes | None]:
        """Many named values in one round trip per thousand, in order; None where there is none."""
        return self.values.get_many(names)

    # ── plumbing ──────────────────────────────────────────────────────────────────────────────────────
    def _block_ms(self, block_ms: int | None) -> int:
        block = self.settings.block_ms if block_ms is None else block_ms
        if not 0 <= block < self.settings.socket_timeout_s * 1000:
            raise ValueError(f"block_ms must be in [0, socket timeout {self.settings.socket_timeout_s} s)")
        return block

    def _ensure_group(self, kind: StreamKind) -> None:
        # Created at id 0, so prompts fed before any worker started (or re-added after Redis lost the
        # group) are all delivered.
        try:
            self._redis.xgroup_create(self.stream_key(kind), self.groups[kind], id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._groups_ready.add(kind)

    def _run(self, call: Callable[[], T], kind: StreamKind | None = None) -> T:
        """Run `call`; on connection loss, or a Redis that refuses writes, retry as `self.reconnect` says
        (reconnect.py). Every call is safe to retry: ids make a repeated publish or mark harmless, and a
        refused script ran nothing (Redis refuses a script at its first write)."""
        outage = self.reconnect.outage()
        regrouped = False
        while True:
            try:
                if kind is not None and kind not in self._groups_ready:
                    self._ensure_group(kind)
                result = call()
            except ResponseError as exc:
                if refused_write(exc):  # out of memory, a failing disk, a replica: ridden out as an outage
                    outage.wait(exc)
                    continue
                # A Redis that restarted without persistence, or was flushed, lost the group: recreate it.
                if kind is None or regrouped or not is_missing_group(exc):
                    raise
                log.warning("consumer group %r vanished from %s; recreating it", self.groups[kind], self.url)
                self._groups_ready.discard(kind)
                regrouped = True
                continue
            except (RedisConnectionError, RedisTimeoutError) as exc:
                outage.wait(exc)
                continue
            outage.over()
            return result
