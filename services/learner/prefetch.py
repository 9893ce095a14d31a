"""The learner's intake off its loop (issue 50, item 2): a thread reads the trajectory stream ahead — the
Redis reads and each group's decoding and validation — while the loop trains, so the next step's groups
are in hand when the step ends.

It holds at most one step's groups (`learner.prompts_per_step`) and `learner.read_ahead_mb` of payload.
Everything that decides what a group becomes stays on the loop (`collect.py`): the trained marks, the
staleness rule, the dead letters of groups the model cannot take, the batch. A group read ahead is, to
Redis, an entry delivered to the learner and not yet acknowledged — as a held group is — so a crash
leaves it pending, and it comes again. A read reclaims the consumer's idle entries (a dead learner's), so
before each read, and while it waits for room, the thread keeps alive (`touch`) its own entries and the
loop's: the groups it holds and the batch it trains. An error of the thread's (Redis gone past its
retries) is raised on the loop at its next take.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from sparkrl.proto import TrajectoryGroup, decode_group
from sparkrl.services.common.bus import Entry, RedisBus

log = logging.getLogger("sparkrl.learner")

READ_BLOCK_MS = 200  # a read waits this long for new entries, so a stop is seen within it
Read = list[tuple[Entry, TrajectoryGroup]]


class Prefetch(threading.Thread):
    """Reads ahead into a bounded queue; the loop `take`s from it instead of reading Redis."""

    def __init__(
        self, bus: RedisBus, consumer: str, max_groups: int, max_bytes: int, held: Callable[[], list[str]]
    ) -> None:
        """`held`: the entry ids the loop holds (its groups, the batch it trains): a read reclaims the
        consumer's idle entries, so these are kept alive before each read, as the loop's own reads did."""
        super().__init__(name="intake-read-ahead", daemon=True)
        self.bus, self.consumer, self.max_groups, self.max_bytes = bus, consumer, max_groups, max_bytes
        self.held = held
        self.queue: deque[tuple[Entry, TrajectoryGroup]] = deque()
        self.bytes = 0
        self.changed = threading.Condition()
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self.touch_every_s = bus.settings.claim_idle_ms / 4000  # well before the entries count as idle

    def run(self) -> None:
        touched = time.monotonic()
        try:
            while not self.stopped.is_set():
                room = self._room()
                if room == 0:
                    with self.changed:
                        self.changed.wait(self.touch_every_s)
                else:
                    self._keep_alive()  # nothing in hand may be idle when the read reclaims idle entries
                    touched = time.monotonic()
                    read = self.bus.read_decoded(
                        "trajectories", self.consumer, room, decode_group, READ_BLOCK_MS
                    )
                    with self.changed:
                        self.queue.extend(read)
                        self.bytes += sum(len(entry.payload) for entry, _ in read)
                        self.changed.notify_all()
                if time.monotonic() - touched > self.touch_every_s:
                    self._keep_alive()
                    touched = time.monotonic()
        except BaseException as exc:  # told to the loop at its next take; the entries stay pending
            if not self.stopped.is_set():
                log.exception("the intake's read-ahead stopped")
                self.error = exc
        finally:
            with self.changed:
                self.changed.notify_all()

    def take(self, count: int, block_ms: int) -> Read:
        """Up to `count` groups read ahead, oldest first, waiting up to `block_ms` for the first (a thread
        that stopped without an error leaves the reading to the caller: read from Redis here)."""
        deadline = time.monotonic() + block_ms / 1000
        if not self.is_alive() and self.error is None and not self.queue:
            return self.bus.read_decoded("trajectories", self.consumer, count, decode_group, block_ms)
        with self.changed:
            while not self.queue and self.error is None and self.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.changed.wait(left)
            if self.error is not None:
                raise self.error
            taken = [self.queue.popleft() for _ in range(min(count, len(self.queue)))]
            self.bytes -= sum(len(entry.payload) for entry, _ in taken)
            self.changed.notify_all()  # room again
        return taken

    def _keep_alive(self) -> None:
        self.bus.touch("trajectories", self.consumer, self.held() + self.entry_ids())

    def entry_ids(self) -> list[str]:
        with self.changed:
            return [entry.entry_id for entry, _ in self.queue]

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops reading (what it holds stays pending in Redis: the next learner takes it)."""
        self.stopped.set()
        with self.changed:
            self.changed.notify_all()
        if self.is_alive():
            self.join(timeout_s)

    def _room(self) -> int:
        with self.changed:
            if self.bytes >= self.max_bytes:
                return 0
            return max(0, self.max_groups - len(self.queue))
