"""A pool of verifier processes that can kill one stuck item: per-item deadlines off the main thread.

`concurrent.futures.ProcessPoolExecutor` cannot cancel a running task, and a sympy parse of a hostile
answer can run for minutes, so each slot owns one worker process and one pipe. A slot thread takes a job,
sends it, and waits on the pipe at most the item's time limit; past it, the worker is SIGKILLed and a
fresh one forked (from a forkserver that has already imported sympy and math_verify, so a restart costs
milliseconds, not the seconds of a cold import). Jobs go to whichever slot is free, so items of one batch
run in parallel; each job's `Future` resolves to its own `RewardResult`, so callers keep request order.
Requests are served fairly (`scheduler.py`); a running job is watched in short slices, so a cancelled
request (its client went away) or a preemption in favour of another request stops it at once.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from sparkrl.proto.reward import RewardResult
from sparkrl.services.reward.scheduler import FairQueue, Job
from sparkrl.services.reward.verifiers import VerifyFn, run_verifier

log = logging.getLogger("sparkrl.reward.pool")

# Imported once by the forkserver, so every forked worker starts with its own code (this module, whose
# `_worker_main` it runs) and warm verifiers already loaded: a restart then costs tens of milliseconds.
_PRELOAD = ["sparkrl.services.reward.pool", "sparkrl.services.reward.preload"]
_KILL_WAIT_S = 5.0
_WATCH_S = 0.05  # how often a running job checks for a cancelled request or a preemption
# A watch slice that took longer than this was the whole service stopped (SIGSTOP of its process group,
# as `bench/hold_experiment.py` pauses an experiment; a suspended VM), not the item running: it counts as
# this much of the item's limit. Without the cap, every item in flight across a pause timed out on resume.
_STALL_S = 1.0
_SHUTDOWN = "the reward service is shutting down"


@dataclass
class PoolStats:
    """What `/healthz` and `/metrics` report. Counters only grow."""

    processes: int
    alive: int
    busy: int
    queued: int
    restarts: int
    timeouts: int
    crashes: int


def _worker_main(conn: Connection, verifiers: dict[str, VerifyFn]) -> None:
    """One worker: receive (task, completion, answer, task_data), send (score, status, detail), repeat."""
    # Ctrl-C reaches the whole process group; shutdown is the parent's call (it kills us), not ours.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # math_verify logs a warning per parse failure and one about the disabled timeout; both are expected
    # here (failures become `no_answer`, the pool owns the timeout) and would flood the service's log.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    while True:
        try:
            task, completion, answer, task_data = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed the pipe or died: nothing left to serve
        conn.send(run_verifier(verifiers[task], completion, answer, task_data))


class _Slot:
    """One worker process and the parent's end of its pipe; `close()` may stop it from another thread."""

    def __init__(self, context: Any, verifiers: dict[str, VerifyFn], index: int) -> None:
        self.index = index
        self._context = context
        self._verifiers = verifiers
        self._lock = threading.Lock()
        self.process: BaseProcess | None = None
        self.conn: Connection | None = None

    def start(self) -> None:
        parent_end, child_end = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_worker_main,
            args=(child_end, self._verifiers),
            name=f"reward-verifier-{self.index}",
            daemon=True,
        )
        with self._lock:
            process.start()
            child_end.close()  # keep only the child's copy, so the child's death reads as EOF here
            self.process, self.conn = process, parent_end

    def alive(self) -> bool:
        with self._lock:
            return self.process is not None and self.process.is_alive()

    def stop(self) -> int | None:
        """Kill the worker (SIGKILL: a stuck sympy call ignores anything gentler); returns its exit code."""
        with self._lock:
            process, conn = self.process, self.conn
            self.process, self.conn = None, None
        exitcode = None
        if process is not None:
            # Kill before closing our end: a slot thread blocked in `poll` on it wakes on the child's EOF.
            process.kill()
            process.join(_KILL_WAIT_S)
            exitcode = process.exitcode
            if exitcode is not None:
                process.close()
        if conn is not None:
            conn.close()
        return exitcode


class VerifierPool:
    """`submit(...)` → `Future[RewardResult]`; `start()` before, `close()` after."""

    def __init__(self, processes: int, verifiers: dict[str, VerifyFn]) -> None:
        if processes < 1:
            raise ValueError(f"a verifier pool needs at least one process, got {processes}")
        for name, fn in verifiers.items():
            try:
                pickle.dumps(fn)
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                raise ValueError(
                    f"verifier {name!r} ({fn!r}) must be a module-level function: workers import it by name"
                ) from exc
        self.processes = processes
        self.verifiers = dict(verifiers)
        self._jobs = FairQueue(processes)
        self._lock = threading.Lock()
        self._slots: list[_Slot] = []
        self._threads: list[threading.Thread] = []
        self._started = False
        self._closed = False
        self._busy = 0
        self._restarts = 0
        self._timeouts = 0
        self._crashes = 0

    def start(self) -> None:
        context = multiprocessing.get_context("forkserver")
        # Forking the service itself would copy its event loop and threads into the child; the forkserver is a
        # clean single-threaded parent. Preload applies only if this process has not started a forkserver yet.
        context.set_forkserver_preload(_PRELOAD)
        with self._lock:
            if self._started:
                raise RuntimeError("the verifier pool is already started")
            self._started = True
            for index in range(self.processes):
                slot = _Slot(context, self.verifiers, index)
                slot.start()
                thread = threading.Thread(
                    target=self._serve, args=(slot,), name=f"reward-slot-{index}", daemon=True
                )
                self._slots.append(slot)
                self._threads.append(thread)
        for thread in self._threads:
            thread.start()

    def submit(
        self,
        task: str,
        completion: str,
        answer: str | None,
        task_data: dict[str, Any] | None,
        timeout_s: float,
        request_id: str = "",
        deadline: float | None = None,
    ) -> Future[RewardResult]:
        """Queue one item of request `request_id` (its turn comes round-robin with other requests'); it
        runs at most `timeout_s`, and not past `deadline` (monotonic: the request's budget)."""
        if task not in self.verifiers:
            raise KeyError(f"unknown task {task!r}; known: {', '.join(sorted(self.verifiers))}")
        job = Job(request_id, task, completion, answer, task_data, timeout_s, deadline)
        with self._lock:
            # Under the lock: `close()` drains the queue once, so nothing may enter it after `_closed`.
            if not self._started or self._closed:
                raise RuntimeError("the verifier pool is not running")
            self._jobs.put(job)
        return job.future

    def cancel(self, request_id: str) -> int:
        """The request's client went away: drop its queued items, stop its running ones; how many."""
        queued = self._jobs.cancel(request_id)
        for job in queued:
            _fail(job, "cancelled: the client went away")
        return len(queued)

    def stats(self) -> PoolStats:
        with self._lock:
            alive = sum(slot.alive() for slot in self._slots)
            return PoolStats(
                processes=self.processes,
                alive=alive,
                busy=self._busy,
                queued=self._jobs.qsize(),
                restarts=self._restarts,
                timeouts=self._timeouts,
                crashes=self._crashes,
            )

    def close(self) -> None:
        """Fail what is queued, kill the workers, stop the slot threads. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for job in self._jobs.close():  # also wakes every slot thread waiting for a job
            _fail(job, _SHUTDOWN)
        for slot in self._slots:
            # Killing the worker wakes a slot thread blocked on its pipe (EOF), which then sees `_closed`.
            slot.stop()
        for thread in self._threads:
            thread.join(_KILL_WAIT_S)

    def _serve(self, slot: _Slot) -> None:
        while True:
            job = self._jobs.get(slot.index)
            if job is None:
                return
            # A preempted job runs again with its future running already; a fresh one may have been given
            # up on (its request cancelled) before it ran.
            if not job.preempted and not job.future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._busy += 1
            try:
                result = self._run(slot, job)
            except Exception as exc:
                # A bug here must fail the item, not kill the thread and shrink the pool for good.
                log.exception("verifier slot %d failed on a %s item", slot.index, job.task)
                result = _result(0.0, "error", f"verifier pool error: {type(exc).__name__}: {exc}", 0.0)
            with self._lock:
                self._busy -= 1
            self._jobs.done(slot.index)
            if result is not None:
                job.future.set_result(result)

    def _run(self, slot: _Slot, job: Job) -> RewardResult | None:
        """The job's result; None when it was preempted (it is back in its queue)."""
        limit = job.limit()
        if limit <= 0:
            return _result(0.0, "timeout", "the request's time budget was spent before this item ran", 0.0)
        if not slot.alive():
            self._restart(slot, "it was found dead between items")
        conn = slot.conn
        if conn is None:
            return _result(0.0, "error", _SHUTDOWN, 0.0)
        started = time.monotonic()
        watched = 0.0  # the item's time: watch slices, each counted at most _STALL_S (see _STALL_S)
        try:
            conn.send((job.task, job.completion, job.answer, job.task_data))
            while (left := limit - watched) > 0:
                before = time.monotonic()
                if conn.poll(min(_WATCH_S, left)):
                    score, status, detail = conn.recv()
                    return _result(score, status, detail, time.monotonic() - started)
                watched += min(time.monotonic() - before, _STALL_S)
                if job.cancelled:
                    self._restart(slot, "its request was cancelled (the client went away)")
                    return _result(
                        0.0, "error", "cancelled: the client went away", time.monotonic() - started
                    )
                if self._jobs.must_yield(slot.index):
                    self._restart(slot, f"preempted a {job.task} item for a waiting request")
                    self._jobs.requeue(job)
                    return None
        except (EOFError, OSError) as exc:
            elapsed = time.monotonic() - started
            if self._closed:
                return _result(0.0, "error", _SHUTDOWN, elapsed)
            with self._lock:
                self._crashes += 1
            code = self._restart(slot, f"it died on a {job.task} item ({exc!r})")
            return _result(
                0.0, "error", f"the verifier process died on this item (exit code {code})", elapsed
            )
        elapsed = time.monotonic() - started
        with self._lock:
            self._timeouts += 1
        self._restart(slot, f"a {job.task} item ran past {limit:g}s")
        return _result(0.0, "timeout", f"verification ran past the {limit:g}s limit", elapsed)

    def _restart(self, slot: _Slot, reason: str) -> int | None:
        """Replace the slot's worker (unless closing); returns the old worker's exit code."""
        code = slot.stop()
        with self._lock:
            if self._closed:
                return code
            self._restarts += 1
            # Under the pool lock, so `close()` cannot miss a worker started while it runs.
            slot.start()
        log.warning("restarted verifier process %d (exit code %s): %s", slot.index, code, reason)
        return code


def _fail(job: Job, detail: str) -> None:
    """Answer a job that will not run (a preempted one's future is running already)."""
    if job.future.running() or job.future.set_running_or_notify_cancel():
        job.future.set_result(_result(0.0, "error", detail, 0.0))


def _result(score: float, status: str, detail: str, elapsed_s: float) -> RewardResult:
    return RewardResult(score=score, status=status, detail=detail, elapsed_s=max(elapsed_s, 0.0))
