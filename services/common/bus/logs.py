"""Capped logs on Redis Streams: telemetry (step rows, sync history, events) and the control stream.

Unlike the work streams there is no consumer group: every reader sees every record, following from a
cursor (`follow`) or reading back from the newest (`tail`). Writers cap each log at about `maxlen`
records (`XADD MAXLEN ~`, so trimming stays O(1)); a reader that falls that far behind loses the oldest.
Payloads are opaque (JSON text from `sparkrl.proto`); this module knows nothing of what they mean.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import redis

from sparkrl.services.common.bus._part import BusPart, Runner

START = "0-0"  # a cursor before every record


class Record(NamedTuple):
    log: str  # the log's name (`metrics`, `control`, ...)
    record_id: str  # Redis stream id, increasing: a cursor
    payload: bytes


class LogStreams(BusPart):
    """The logs of one namespace: `{ns}:log:<name>`. Thread-safe like the client it wraps."""

    maxlen: int

    def __init__(self, client: redis.Redis, run: Runner[Any], namespace: str, maxlen: int) -> None:
        super().__init__(client, run, namespace)
        self.maxlen = maxlen

    def key(self, log: str) -> str:
        return f"{self._namespace}:log:{log}"

    def append(self, log: str, payload: str | bytes) -> str:
        """Add a record; returns its id. The log is trimmed to about `maxlen` records."""
        key = self.key(log)
        record_id = self._run(
            lambda: self._redis.xadd(key, {"payload": payload}, maxlen=self.maxlen, approximate=True)
        )
        return _text(record_id)

    def tail(self, log: str, count: int, before: str | None = None) -> list[Record]:
        """Up to `count` records, newest first, strictly older than `before` (None: from the newest)."""
        key = self.key(log)
        newest = "+" if before is None else f"({before}"
        rows = self._run(lambda: self._redis.xrevrange(key, max=newest, min="-", count=count))
        return [Record(log, _text(rid), fields.get(b"payload", b"")) for rid, fields in rows]

    def length(self, log: str) -> int:
        return int(self._run(lambda: self._redis.xlen(self.key(log))))

    def last_id(self, log: str) -> str:
        """The newest record's id (START when empty): a cursor from which `follow` yields only new ones."""
        newest = self.tail(log, 1)
        return newest[0].record_id if newest else START

    def follow(self, cursors: dict[str, str], block_ms: int | None, count: int = 256) -> list[Record]:
        """Records after each log's cursor, oldest first per log; waits up to `block_ms` (None or 0: do not
        wait) when there are none. The caller advances its cursors to the ids it got."""
        if not cursors:
            return []
        streams = {self.key(log): cursor for log, cursor in cursors.items()}
        names = {self.key(log): log for log in cursors}
        block = block_ms or None
        reply = self._run(lambda: self._redis.xread(streams, count=count, block=block))
        if isinstance(reply, dict):  # RESP3 answers a map
            reply = list(reply.items())
        return [
            Record(names[_text(key)], _text(rid), fields.get(b"payload", b""))
            for key, rows in reply or []
            for rid, fields in rows
        ]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
