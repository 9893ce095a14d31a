"""What crosses the bus's API: entries, dead letters, queue depth, and the bus's errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

StreamKind = Literal["prompts", "trajectories"]
# The consumer group of each stream: rollout workers share the prompts, the learner takes the groups.
GROUPS: dict[str, str] = {"prompts": "rollout", "trajectories": "learner"}


class BusError(RuntimeError):
    """Base of the bus's own errors."""


class BusUnavailable(BusError):
    """Redis stayed unreachable for `reconnect_max_s`."""


class BusStopping(BusUnavailable):
    """Redis was unreachable while the service was stopping (the bus's `stop` was set), so the bus stopped
    reconnecting after `STOPPING_RECONNECT_S`. Nothing is lost: what the service held and did not
    acknowledge stays pending in Redis, for another consumer to reclaim."""


class BusBackpressureTimeout(BusError):
    """A stream stayed full (nobody consumed) for the whole publish timeout."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One stream entry as a consumer sees it."""

    entry_id: str  # Redis stream entry id: what `ack` and `dead_letter` take
    item_id: str  # the prompt id or group id it was published under
    payload: bytes
    deliveries: int  # 1 on first delivery; each reclaim from a dead consumer adds one


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One record of the dead-letter stream."""

    stream: str  # the key of the stream the entry came from
    entry_id: str
    item_id: str
    reason: str
    payload: bytes
    time_ms: int  # wall-clock milliseconds when it was dead-lettered
    deliveries: int
    record_id: str = ""  # its own id in `{ns}:dead` (what `requeue_dead_letter` takes)

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes], record_id: str = "") -> DeadLetter:
        """From a `{ns}:dead` stream entry as Redis returns it."""

        def text(name: bytes) -> str:
            return fields[name].decode(errors="replace")

        return cls(
            stream=text(b"stream"),
            entry_id=text(b"entry_id"),
            item_id=text(b"id"),
            reason=text(b"reason"),
            payload=fields[b"payload"],
            time_ms=int(fields[b"time_ms"]),
            deliveries=int(fields[b"deliveries"]),
            record_id=record_id,
        )


class QueueDepth(NamedTuple):
    lag: int  # entries in the stream not yet delivered to the group
    pending: int  # delivered, not yet acknowledged
