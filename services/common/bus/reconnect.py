"""How the bus rides out a lost connection, or a Redis that refuses writes (out of memory, a disk it cannot
write, a read-only replica): exponential backoff with jitter for `bus.reconnect_max_s`, then
`BusUnavailable`; for a service that is stopping, at most `STOPPING_RECONNECT_S`, then `BusStopping`.

`RedisBus` runs every call through one `Reconnect`; each call keeps its own `Outage` while it fails."""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass

from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError

from sparkrl.services.common.bus.records import BusStopping, BusUnavailable

log = logging.getLogger("sparkrl.bus")

_BACKOFF_BASE_S = 0.05
_BACKOFF_CAP_S = 2.0
# How long a stopping service (its `stop` set) still tries to reach Redis: a blip during a clean stop is
# ridden out; a Redis that is down does not hold the stop for `reconnect_max_s`.
STOPPING_RECONNECT_S = 2.0


# The error codes of a Redis that is up but takes no writes for now: `maxmemory` reached (with noeviction),
# a failed background save or AOF write (`stop-writes-on-bgsave-error`), a replica. Each passes once the
# operator acts (memory freed or raised, disk space back, a failover), like an outage; anything else a
# ResponseError says is a bug or bad input and is raised at once.
_REFUSED_WRITE_CODES = ("OOM", "MISCONF", "READONLY", "NOREPLICAS")


def refused_write(exc: ResponseError) -> bool:
    """Whether Redis refused a write for now (not for good): the call is retried as after a lost link.
    redis-py turns OOM and READONLY into their own classes and drops the code from the message."""
    if isinstance(exc, OutOfMemoryError | ReadOnlyError):
        return True
    words = str(exc).split(maxsplit=1)
    return bool(words) and words[0] in _REFUSED_WRITE_CODES


@dataclass
class Reconnect:
    """The policy: `url` (password masked) for messages; `max_s` and the setting it came from; the
    service's `stop`, if it has one."""

    url: str
    max_s: float
    setting: str = "bus.reconnect_max_s"
    stop: threading.Event | None = None
    gave_up: bool = False  # a call gave up while stopping: later ones do not wait again
    trouble: str | None = None  # what a call is waiting out now (for a status), None while Redis answers

    def outage(self) -> Outage:
        return Outage(self)


@dataclass
class Outage:
    """One call's failures: `wait` after each (or raise when the time is up), `over` once it succeeds."""

    policy: Reconnect
    since: float | None = None
    attempt: int = 0

    def wait(self, exc: Exception) -> None:
        """Sleep before the next try, or raise `BusStopping` / `BusUnavailable` (from `exc`)."""
        p, now = self.policy, time.monotonic()
        self.since = now if self.since is None else self.since
        waited = now - self.since
        stopping = p.stop is not None and p.stop.is_set()
        limit = min(p.max_s, STOPPING_RECONNECT_S) if stopping else p.max_s
        p.trouble = describe(exc)
        how = "refused writes" if isinstance(exc, ResponseError) else "unreachable"
        if stopping and (waited >= limit or p.gave_up):  # one call's wait is the whole stop's
            p.gave_up = True
            raise BusStopping(f"Redis at {p.url} {how} while stopping: {detail(exc)}") from exc
        if waited >= limit:
            raise BusUnavailable(
                f"Redis at {p.url} {how} for {waited:.1f} s ({p.setting}={p.max_s:g}): {detail(exc)}"
            ) from exc
        # The exponent is capped: a float overflows past 2**1023 (a Redis down for half an hour).
        backoff = min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2.0 ** min(self.attempt, 16))
        delay = min(backoff * random.uniform(0.5, 1.0), limit - waited)
        self.attempt += 1
        # A first failure retried at once is no outage: a pooled connection Redis closed while it idled
        # (`sparkrl up`'s Redis closes idle clients) fails once, then reconnects. From the second on, said.
        say = log.debug if self.attempt == 1 and not isinstance(exc, ResponseError) else log.warning
        say(
            "Redis at %s: %s; %s %d in %.2f s (up to %s=%g)",
            p.url,
            p.trouble,
            "retry" if isinstance(exc, ResponseError) else "reconnect attempt",
            self.attempt,
            delay,
            p.setting,
            p.max_s,
        )
        if p.stop is None or stopping:
            time.sleep(delay)
        else:
            p.stop.wait(delay)  # a stop cuts the wait short: the next try has the stopping limit

    def over(self) -> None:
        if self.since is not None:
            self.policy.trouble = None
            log.info("Redis at %s answers again after %.1f s", self.policy.url, time.monotonic() - self.since)


def describe(exc: Exception) -> str:
    """The trouble in words: `refuses writes (OOM command not allowed ...)` or the connection error."""
    return f"refuses writes ({detail(exc)})" if isinstance(exc, ResponseError) else detail(exc)


def detail(exc: Exception) -> str:
    """The error's message, with the code redis-py dropped from it put back (`OOM ...`)."""
    codes = {OutOfMemoryError: "OOM ", ReadOnlyError: "READONLY "}
    return codes.get(type(exc), "") + (str(exc) or type(exc).__name__)
