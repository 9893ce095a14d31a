"""The telemetry channel: the one place that writes and reads what the fleet reports.

- Statuses (heartbeats): the learner's `LearnerStatus` and each worker's `WorkerStatus`, as Redis values.
  A worker's vanishes a few heartbeats after its last (TTL); the learner's stays (so a stopped learner
  still says `stopped`) and is live while its `heartbeat_at` is recent.
- Logs (capped Redis streams, `bus.telemetry_maxlen` records each): `metrics` (one `StepMetrics` per
  step), `syncs` (one `SyncEvent` per broadcast), `commands` (`CommandResult`s) and `states`
  (`StateEvent`s) and `evals` (the evaluator's `EvalRecord`s).

Writers: learner and rollout workers. Readers: the control service (REST, events, page, Prometheus), the
launcher's progress line, and the learner itself (the fleet's versions for its rows and broadcasts).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, TypeVar

from pydantic import BaseModel, ValidationError

from sparkrl.proto import LearnerStatus, WorkerStatus
from sparkrl.proto.telemetry import CommandResult, EvalRecord, StateEvent, StepMetrics, SyncEvent
from sparkrl.services.common.bus import Record, RedisBus

log = logging.getLogger("sparkrl.telemetry")

LEARNER = "learner"  # the learner's status id and command target
WORKER_KIND = "worker"
LEARNER_KIND = "learner"
# The learner's status outlives it (a stopped run still says so); liveness is the heartbeat's age.
LEARNER_STATUS_TTL_S = 7 * 24 * 3600.0
LEARNER_HEARTBEAT_S = 2.0
LEARNER_ALIVE_S = 5 * LEARNER_HEARTBEAT_S

EventKind = Literal["step", "sync", "command", "state", "eval"]
LOGS: dict[EventKind, tuple[str, type[BaseModel]]] = {
    "step": ("metrics", StepMetrics),
    "sync": ("syncs", SyncEvent),
    "command": ("commands", CommandResult),
    "state": ("states", StateEvent),
    "eval": ("evals", EvalRecord),
}
_KIND_OF_LOG = {name: kind for kind, (name, _) in LOGS.items()}
_CHUNK = 256  # records read back per round trip
M = TypeVar("M", bound=BaseModel)


def worker_target(worker_id: str) -> str:
    """A worker's name as a command target and in events: `worker:<id>`."""
    return f"worker:{worker_id}"


@dataclass(frozen=True)
class Event:
    """One telemetry record as a follower sees it."""

    kind: EventKind
    cursor: str  # the record's id in its log
    message: BaseModel


class Telemetry:
    """Both sides of the channel over one bus. Thread-safe like the bus."""

    bus: RedisBus

    def __init__(self, bus: RedisBus) -> None:
        self.bus = bus

    # ── statuses ──────────────────────────────────────────────────────────────────────────────────────
    def put_learner(self, status: LearnerStatus) -> None:
        self.bus.put_status(LEARNER_KIND, LEARNER, status.model_dump_json(), ttl_s=LEARNER_STATUS_TTL_S)

    def learner(self) -> LearnerStatus | None:
        """The learner's last status (live or not: see `learner_alive`); None if it never reported."""
        raw = self.bus.status(LEARNER_KIND, LEARNER)
        return _parse(LearnerStatus, raw, "learner status") if raw is not None else None

    @staticmethod
    def learner_alive(status: LearnerStatus | None, now: float | None = None) -> bool:
        """A learner is live while its heartbeat is recent and it has not stopped."""
        if status is None or status.state == "stopped":
            return False
        return (now or time.time()) - status.heartbeat_at < LEARNER_ALIVE_S

    def put_worker(self, status: WorkerStatus, ttl_s: float) -> None:
        self.bus.put_status(WORKER_KIND, status.worker_id, status.model_dump_json(), ttl_s=ttl_s)

    def workers(self) -> dict[str, WorkerStatus]:
        """Every worker with a live heartbeat (stopping ones included), by id."""
        workers = {}
        for worker_id, raw in sorted(self.bus.statuses(WORKER_KIND).items()):
            status = _parse(WorkerStatus, raw, f"status of {worker_id}")
            if status is not None:
                workers[worker_id] = status
        return workers

    def live_workers(self) -> dict[str, WorkerStatus]:
        """The fleet a broadcast goes to: live heartbeats, not shutting down."""
        return {w: s for w, s in self.workers().items() if s.state != "stopping"}

    def worker_versions(self) -> dict[str, int | None]:
        return {w: s.policy_version for w, s in self.live_workers().items()}

    def worker_oldest_versions(self) -> dict[str, int | None]:
        """Per live worker, the oldest version its coming groups can carry: the one it holds, or older
        groups it has in hand (made before it followed newer weights, not yet published)."""
        oldest = {}
        for worker, s in self.live_workers().items():
            held = s.policy_version
            oldest[worker] = held if s.in_hand_version is None else min(s.in_hand_version, held or 0)
        return oldest

    def wait_for_fleet(self, members: tuple[str, ...], version: int, timeout_s: float) -> bool:
        """Until every member's heartbeat reports `version` (workers beat right after loading weights, but
        after acknowledging them, so the status can trail the broadcast by a moment); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            held = self.worker_versions()
            if all(held.get(member) == version for member in members):
                return True
            time.sleep(0.05)
        return False

    # ── logs ──────────────────────────────────────────────────────────────────────────────────────────
    def append(self, message: StepMetrics | SyncEvent | CommandResult | StateEvent | EvalRecord) -> str:
        """Add a record to the log of its type; returns its cursor."""
        kind = next(k for k, (_, cls) in LOGS.items() if isinstance(message, cls))
        return self.bus.logs.append(LOGS[kind][0], message.model_dump_json())

    def steps(self, since: int = 0, limit: int = 1000) -> list[StepMetrics]:
        """Step rows with step > `since`, oldest first, at most `limit` (the oldest of them).

        After a resume from an older checkpoint the log holds the discarded steps too (e.g. 1..15, then
        11, 12): walking back from the newest, only rows below every step already taken are kept, so the
        answer is the run's current history (1..10, 11, 12).
        """
        rows: list[StepMetrics] = []
        for row in self._newest_first("step"):
            assert isinstance(row, StepMetrics)
            if row.step <= since:
                break
            if not rows or row.step < rows[-1].step:
                rows.append(row)
        return rows[::-1][:limit]

    def last_step(self) -> StepMetrics | None:
        return next(self._newest_first("step"), None)  # type: ignore[arg-type]

    def syncs(self, offset: int = 0, limit: int = 50) -> tuple[list[SyncEvent], int]:
        """A page of the sync history, newest first; and how many records are kept."""
        page: list[SyncEvent] = []
        for index, event in enumerate(self._newest_first("sync")):
            if index >= offset + limit:
                break
            if index >= offset:
                assert isinstance(event, SyncEvent)
                page.append(event)
        return page, self.bus.logs.length(LOGS["sync"][0])

    def evals(self, limit: int = 200) -> list[EvalRecord]:
        """The evaluator's newest `limit` records, oldest first."""
        newest = list(itertools.islice(self._newest_first("eval"), limit))
        return newest[::-1]  # type: ignore[return-value]

    def last_sync(self) -> SyncEvent | None:
        return next(self._newest_first("sync"), None)  # type: ignore[arg-type]

    def cursors_now(self) -> dict[str, str]:
        """A cursor per log at its newest record: following from here yields only what comes next."""
        return {name: self.bus.logs.last_id(name) for name, _ in LOGS.values()}

    def follow(self, cursors: dict[str, str], block_ms: int | None) -> list[Event]:
        """New records after `cursors` (log name → cursor; advanced in place), oldest first per log."""
        events = []
        for record in self.bus.logs.follow(cursors, block_ms):
            cursors[record.log] = record.record_id
            event = self._decode(record)
            if event is not None:
                events.append(event)
        return events

    def _newest_first(self, kind: EventKind) -> Iterator[BaseModel]:
        """Records newest first, read back in growing chunks: most readers want only the newest few."""
        name, chunk = LOGS[kind][0], 4
        before: str | None = None
        while True:
            records = self.bus.logs.tail(name, chunk, before)
            for record in records:
                event = self._decode(record)
                if event is not None:
                    yield event.message
            if len(records) < chunk:
                return
            before, chunk = records[-1].record_id, min(2 * chunk, _CHUNK)

    @staticmethod
    def _decode(record: Record) -> Event | None:
        kind = _KIND_OF_LOG[record.log]
        message = _parse(LOGS[kind][1], record.payload, f"{record.log} record {record.record_id}")
        return Event(kind, record.record_id, message) if message is not None else None


def _parse(cls: type[M], raw: str | bytes, what: str) -> M | None:
    # A reader must outlive a malformed record (another build, a hand edit): skip it, loudly.
    try:
        return cls.model_validate_json(raw)
    except ValidationError as exc:
        log.warning("ignoring a malformed %s: %s", what, exc.errors()[0]["msg"] if exc.errors() else exc)
        return None
