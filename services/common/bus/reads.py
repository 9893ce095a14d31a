"""Reading a stream's new entries over several connections at once, when many are waiting.

Redis writes each connection about one reply block per turn of its event loop, and a trajectory group is
a block of a megabyte or more: behind a fleet's publishes, which lengthen every turn (a Lua call and an
append-only-file write each), one connection drains a backlog at about one group per turn, however many
its read asks for. That capped the learner's intake (bench/fleet_scale.py, docs/benchmarks.md). So a read
takes a first chunk as before (blocking only when the stream is empty); if that chunk came back full,
more are waiting, and the rest is read at once, without blocking, over `readers` connections. A read
that fails part-way (the bus retries it whole) leaves what its other connections took pending: later
reads reclaim it after `bus.claim_idle_ms`, as they do the entries of a reply lost on the way.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis

from sparkrl.services.common.bus._text import text

Row = tuple[bytes, dict[bytes, bytes]]  # (entry id, fields)

CHUNK = 8  # entries per XREADGROUP: a reply of about 12 MB at 8 x 1,024 tokens, top-20
READERS = 4  # connections the rest of a large read spreads over


class Reader:
    """XREADGROUP `>` for one client; thread-safe (redis-py gives each thread its own connection)."""

    _client: redis.Redis
    _readers: int
    _pool: ThreadPoolExecutor | None  # made on the first large read
    _lock: threading.Lock

    def __init__(self, client: redis.Redis, readers: int = READERS) -> None:
        self._client, self._readers, self._pool = client, readers, None
        self._lock = threading.Lock()

    def read_new(self, group: str, consumer: str, key: str, count: int, block_ms: int | None) -> list[Row]:
        """Up to `count` new entries in stream order; blocks up to `block_ms` only while there are none."""
        rows = self._read(group, consumer, key, min(count, CHUNK), block_ms)
        rest = count - len(rows)
        if len(rows) < CHUNK or rest <= 0 or self._readers < 2:
            return rows
        shares = [rest // self._readers + (i < rest % self._readers) for i in range(self._readers)]
        pool = self._executor()
        futures = [pool.submit(self._drain, group, consumer, key, share) for share in shares if share]
        rows += [row for future in futures for row in future.result()]
        # Each connection's rows are in stream order; together they interleave.
        return sorted(rows, key=_order)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def _drain(self, group: str, consumer: str, key: str, count: int) -> list[Row]:
        """Up to `count` entries, a chunk per call, until the stream has none left (never blocking)."""
        rows: list[Row] = []
        while len(rows) < count:
            got = self._read(group, consumer, key, min(CHUNK, count - len(rows)), None)
            if not got:
                break
            rows += got
        return rows

    def _read(self, group: str, consumer: str, key: str, count: int, block_ms: int | None) -> list[Row]:
        reply: Any = self._client.xreadgroup(group, consumer, {key: ">"}, count=count, block=block_ms)
        if isinstance(reply, dict):  # RESP3 answers a map
            reply = list(reply.items())
        return [(entry_id, fields) for _, batch in reply or [] for entry_id, fields in batch]

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._readers, thread_name_prefix="bus-read")
            return self._pool


def _order(row: Row) -> tuple[int, int]:
    ms, _, seq = text(row[0]).partition("-")
    return int(ms), int(seq)
