"""The Redis Streams bus: prompts → rollout workers, trajectory groups → learner, bad entries → dead letters.

Payloads are opaque bytes; decoding is the caller's (`read_decoded` takes the decoder), so this module
knows nothing of `sparkrl.proto`. Guarantees:

- Nothing is lost: a consumer acknowledges only what it has used; an entry left unacknowledged longer than
  `claim_idle_ms` (its consumer died) is reclaimed by the next `read` of any consumer. So a consumer
  acks (or `touch`es) what it holds within `claim_idle_ms`, else it is handed out again; ids make such a
  replay harmless downstream.
- Publishing is idempotent per prompt id / group id, so a retried or re-run producer never adds twice.
  The one exception is deliberate: `send_back` drops a group and feeds its prompt again, forgetting both
  ids, so the group is made anew (the learner's trained marks still keep any id from training twice).
- Back-pressure, never trimming: a producer waits while a stream holds `maxlen` entries. Consumers delete
  what they acknowledge, so a stream's length is exactly unread + pending.
- Every Redis call has a timeout; connection failures are retried with backoff, then `BusUnavailable`.
  A bus given its service's `stop` event retries for at most `STOPPING_RECONNECT_S` once it is set, then
  raises `BusStopping`: a service told to stop while Redis is down stops, rather than reconnecting for
  `reconnect_max_s` until it is killed.
"""

from sparkrl.services.common.bus.logs import LogStreams, Record
from sparkrl.services.common.bus.records import (
    GROUPS,
    BusBackpressureTimeout,
    BusError,
    BusStopping,
    BusUnavailable,
    DeadLetter,
    Entry,
    QueueDepth,
    StreamKind,
)
from sparkrl.services.common.bus.redis_bus import RedisBus

__all__ = [
    "GROUPS",
    "BusBackpressureTimeout",
    "BusError",
    "BusStopping",
    "BusUnavailable",
    "DeadLetter",
    "Entry",
    "LogStreams",
    "QueueDepth",
    "Record",
    "RedisBus",
    "StreamKind",
]
