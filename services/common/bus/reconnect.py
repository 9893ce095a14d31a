"""How the bus rides out a lost connection: exponential backoff with jitter for `bus.reconnect_max_s`, then
`BusUnavailable`; for a service that is stopping, at most `STOPPING_RECONNECT_S`, then `BusStopping`.

`RedisBus` runs every call through one `Reconnect`; each call keeps its own `Outage` while it fails."""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass

from sparkrl.services.common.bus.records import BusStopping, BusUnavailable

log = logging.getLogger("sparkrl.bus")

_BACKOFF_BASE_S = 0.05
_BACKOFF_CAP_S = 2.0
# How long a stopping service (its `stop` set) still tries to reach Redis: a blip during a clean stop is
# ridden out; a Redis that is down does not hold the stop for `reconnect_max_s`.
STOPPING_RECONNECT_S = 2.0


@dataclass
class Reconnect:
    """The policy: `url` (password masked) for messages; `max_s` and the setting it came from; the
    service's `stop`, if it has one."""

    url: str
    max_s: float
    setting: str = "bus.reconnect_max_s"
    stop: threading.Event | None = None
    gave_up: bool = False  # a call gave up while stopping: later ones do not wait again

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
        if stopping and (waited >= limit or p.gave_up):  # one call's wait is the whole stop's
            p.gave_up = True
            raise BusStopping(f"Redis at {p.url} unreachable while stopping: {exc}") from exc
        if waited >= limit:
            raise BusUnavailable(
                f"Redis at {p.url} unreachable for {waited:.1f} s ({p.setting}={p.max_s:g}): {exc}"
            ) from exc
        # The exponent is capped: a float overflows past 2**1023 (a Redis down for half an hour).
        backoff = min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2.0 ** min(self.attempt, 16))
        delay = min(backoff * random.uniform(0.5, 1.0), limit - waited)
        self.attempt += 1
        log.warning("Redis at %s: %s; reconnect attempt %d in %.2f s", p.url, exc, self.attempt, delay)
        if p.stop is None or stopping:
            time.sleep(delay)
        else:
            p.stop.wait(delay)  # a stop cuts the wait short: the next try has the stopping limit

    def over(self) -> None:
        if self.since is not None:
            log.info("reconnected to %s after %.1f s", self.policy.url, time.monotonic() - self.since)
