"""`GET /api/v1/events`: the telemetry channel live, as server-sent events.

Each event is `event: step|sync|command|state`, `data:` the record's JSON, and an `id:` that encodes a
cursor per log, so a client reconnecting with `Last-Event-ID` (browsers do it by themselves) misses
nothing the logs still hold. Without one the stream starts at the newest records. A comment line every
`heartbeat_s` keeps proxies from closing an idle stream.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
from fastapi import Request

from sparkrl.services.common.bus.logs import START
from sparkrl.services.common.telemetry import LOGS, Telemetry

_LOG_NAMES = tuple(name for name, _ in LOGS.values())


def parse_cursor(text: str | None) -> dict[str, str] | None:
    """`metrics=1-0,syncs=0-0,...` → cursors; None when absent. Raises ValueError on a malformed one."""
    if not text:
        return None
    cursors = dict.fromkeys(_LOG_NAMES, START)
    for part in text.split(","):
        name, sep, record_id = part.partition("=")
        ms, dash, seq = record_id.partition("-")
        if not sep or name not in cursors or not (ms.isdigit() and dash and seq.isdigit()):
            raise ValueError(
                f"malformed cursor part {part!r}: expected `<log>=<ms>-<seq>`, logs {_LOG_NAMES}"
            )
        cursors[name] = record_id
    return cursors


def format_cursor(cursors: dict[str, str]) -> str:
    return ",".join(f"{name}={cursors[name]}" for name in _LOG_NAMES)


async def event_stream(
    telemetry: Telemetry,
    request: Request,
    cursors: dict[str, str] | None,
    heartbeat_s: float,
    limit: int | None,
    timeout_s: float | None,
) -> AsyncIterator[str]:
    """Yield SSE frames until the client leaves, `limit` events were sent, or `timeout_s` passed."""
    cursors = cursors or await anyio.to_thread.run_sync(telemetry.cursors_now)
    block_ms = max(10, int(heartbeat_s * 1000))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    sent = 0
    yield "retry: 2000\n\n"
    while not await request.is_disconnected():
        if deadline is not None and time.monotonic() >= deadline:
            return
        delivered = dict(cursors)  # each event's id is the cursor just past it, not past its whole batch
        # redis-py blocks: the wait runs in a worker thread so the event loop keeps serving.
        events = await anyio.to_thread.run_sync(telemetry.follow, cursors, block_ms)
        if not events:
            yield ": keep-alive\n\n"
            continue
        for event in events:
            delivered[LOGS[event.kind][0]] = event.cursor
            data = event.message.model_dump_json()
            yield f"event: {event.kind}\nid: {format_cursor(delivered)}\ndata: {data}\n\n"
            sent += 1
            if limit is not None and sent >= limit:
                return
