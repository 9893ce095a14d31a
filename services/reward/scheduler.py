"""Fair scheduling of verification jobs across requests, for the verifier pool.

One queue per request, served round-robin, so a request of 4,000 items and one of a single item take
turns instead of the single item waiting behind the lot. Round-robin alone still lets a request that got
there first hold every process with slow items; so when a request arrives to find all processes busy and
another request holding more than its fair share (processes / active requests), one of that request's
running jobs is preempted: its process is killed, and the job goes back to the front of its own queue
(verification is a pure function: running it again is harmless). A job is preempted at most once.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sparkrl.proto.reward import RewardResult


@dataclass
class Job:
    request_id: str
    task: str
    completion: str
    answer: str | None
    task_data: dict[str, Any] | None
    timeout_s: float  # this item's own limit
    deadline: float | None  # monotonic: the request's budget ends here, whatever the item's limit
    future: Future[RewardResult] = field(default_factory=Future)
    # The client went away (set under the queue's lock, read by the slot watching the job): a flag, not
    # a threading.Event — one per item was a lock and a condition made for each of ~1,400 items a second.
    cancelled: bool = False
    preempted: bool = False  # went back to its queue once already: never again

    def limit(self) -> float:
        """Seconds this job may run from now: its own limit, within what is left of the budget."""
        if self.deadline is None:
            return self.timeout_s
        return max(0.0, min(self.timeout_s, self.deadline - time.monotonic()))


class FairQueue:
    """`put` jobs, `get` the next one round-robin over requests; tracks who runs what, for preemption."""

    def __init__(self, slots: int) -> None:
        self._slots = slots
        self._queues: OrderedDict[str, deque[Job]] = OrderedDict()  # in turn order
        self._running: dict[int, Job] = {}  # slot index → job
        self._victims: set[int] = set()  # slots asked to give their job back
        self._closed = False
        self._cond = threading.Condition()

    def put(self, job: Job) -> None:
        with self._cond:
            fresh = job.request_id not in self._queues and not self._holds(job.request_id)
            self._queues.setdefault(job.request_id, deque()).append(job)
            if fresh and self._preempt_for_newcomer():
                self._queues.move_to_end(job.request_id, last=False)  # the freed process is for it
            self._cond.notify()

    def requeue(self, job: Job) -> None:
        """A preempted job: first in its own queue, its request at the back of the turn order."""
        with self._cond:
            job.preempted = True
            self._queues.setdefault(job.request_id, deque()).appendleft(job)
            self._queues.move_to_end(job.request_id)  # behind the request it made room for
            self._cond.notify()

    def get(self, slot: int) -> Job | None:
        """The next job for `slot` (blocking); None once closed."""
        with self._cond:
            self._running.pop(slot, None)
            self._victims.discard(slot)
            while not self._queues and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            request_id, queue = next(iter(self._queues.items()))
            job = queue.popleft()
            del self._queues[request_id]
            if queue:  # its next job waits for its next turn, behind the other requests
                self._queues[request_id] = queue
            self._running[slot] = job
            return job

    def done(self, slot: int) -> None:
        with self._cond:
            self._running.pop(slot, None)
            self._victims.discard(slot)

    def must_yield(self, slot: int) -> bool:
        """Whether `slot` was asked to give its job back (checked while the job runs)."""
        with self._cond:
            return slot in self._victims

    def cancel(self, request_id: str) -> list[Job]:
        """Take a request's queued jobs out and flag its running ones; returns the queued ones."""
        with self._cond:
            queued = list(self._queues.pop(request_id, ()))
            for job in self._running.values():
                if job.request_id == request_id:
                    job.cancelled = True
            return queued

    def close(self) -> list[Job]:
        """Stop serving; returns what was still queued."""
        with self._cond:
            self._closed = True
            queued = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            self._cond.notify_all()
            return queued

    def qsize(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def _holds(self, request_id: str) -> bool:
        return any(job.request_id == request_id for job in self._running.values())

    def _preempt_for_newcomer(self) -> bool:
        """Ask one slot of the request most over its fair share to yield; whether one was asked."""
        if len(self._running) < self._slots:
            return False  # a process is free: the newcomer gets it without taking anything
        active = {job.request_id for job in self._running.values()} | set(self._queues)
        fair = math.ceil(self._slots / max(len(active), 1))
        held: dict[str, list[int]] = {}
        for slot, job in self._running.items():
            if slot not in self._victims and not job.preempted:
                held.setdefault(job.request_id, []).append(slot)
        if not held:
            return False
        request_id, slots = max(held.items(), key=lambda item: len(item[1]))
        running = sum(1 for job in self._running.values() if job.request_id == request_id)
        if running <= fair:
            return False
        self._victims.add(slots[-1])
        return True
