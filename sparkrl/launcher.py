"""`sparkrl up`: plan the whole stack, write each service's resolved config, spawn, supervise, summarize.

The launcher resolves, writes, then spawns: `plan_stack` decides ports and every service's settings,
`write_configs` puts them in `RUN_DIR/config/` (`plan.py`), and each service starts from its file alone
(`python -m sparkrl.cli <role> --preset RUN_DIR/config/<service>.yaml`), logging to `RUN_DIR/logs/`.
The progress line reads the telemetry channel, like the control service and its page.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import redis

from sparkrl.dead_letters import save_dead_letters
from sparkrl.plan import STOP_TIERS, Role, ServiceSpec, StackPlan, plan_stack, write_configs
from sparkrl.processes import is_ready, kill_group, spawn
from sparkrl.proto import LearnerStatus, WorkerStatus
from sparkrl.run_report import (
    OpState,
    progress_line,
    startup_facts,
    startup_line,
    startup_text,
    summarize,
)
from sparkrl.services.common.bus import BusError, RedisBus
from sparkrl.services.common.ownership import foreign_owner
from sparkrl.services.common.paths import cache_dir
from sparkrl.services.common.settings import BusSettings, SparkSettings
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.session import Session
from sparkrl.supervision import Restarts, failure, logtail_bytes, on_exit, record_end
from sparkrl.terminal import Terminal, header
from sparkrl.torchrun import is_torchrun, rank_zero

__all__ = [
    "Role",
    "ServiceSpec",
    "Stack",
    "StackError",
    "StackPlan",
    "logtail_bytes",
    "plan_stack",
    "run_stack",
    "write_configs",
]


class StackError(RuntimeError):
    """A service failed to start or died; the message names it and quotes the end of its log."""


def _quick(settings: SparkSettings) -> BusSettings:
    # Short timeouts: a Redis that is down must not stall supervision (the poll reports it) nor shutdown.
    return settings.bus.model_copy(update={"socket_timeout_s": 1.0, "reconnect_max_s": 0.2, "block_ms": 100})


class Stack:
    """The running services: start in order and wait until each is ready, supervise (restarting what
    dies, `supervision.py`), stop in reverse.

    Call from the main thread: a service's parent-death signal fires when the thread that spawned it ends.
    """

    plan: StackPlan
    specs: tuple[ServiceSpec, ...]
    ready_timeout_s: float
    grace_s: float
    keep_fds: tuple[int, ...]  # inherited by every service (the run directory's lock)
    procs: dict[str, subprocess.Popen[bytes]]
    ended: set[str]
    terminal: Terminal  # the progress line and messages
    telemetry: Telemetry | None  # the stack's telemetry channel, once Redis is up
    restarts: Restarts  # each service's restarts, held to `supervision`
    end_reason: str | None  # why the launcher ended the run (a service it could not keep alive)

    def __init__(
        self,
        plan: StackPlan,
        services: Sequence[str] | None = None,
        ready_timeout_s: float = 120.0,
        grace_s: float = 15.0,
        keep_fds: tuple[int, ...] = (),
    ) -> None:
        """`services` picks a subset by name (`worker-1`) or role (`rollout`); None: all of the plan.
        `keep_fds`: what every service inherits (the run directory's lock: held until the last is gone)."""
        wanted = set(services) if services is not None else {s.name for s in plan.services}
        unknown = wanted - {s.name for s in plan.services} - {s.role for s in plan.services}
        if unknown:
            raise ValueError(f"not in the plan: {', '.join(sorted(unknown))}")
        self.plan = plan
        self.specs = tuple(s for s in plan.services if s.name in wanted or s.role in wanted)
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.keep_fds = keep_fds
        self.procs = {}
        self.ended = set()
        self.terminal = Terminal()
        self.telemetry = None
        self.restarts = Restarts(plan.settings.supervision)
        self.end_reason = None
        self.started_at: float | None = None  # when start() began, until the start-up is said
        self.session: Session | None = None  # this start, from start(): which records are its own

    def start(self) -> None:
        """Spawn each service from its written config: Redis first (until it answers PING: everyone talks
        to it), then all the others at once, their imports and model loads overlapping (the reward
        client retries until the service answers); then wait for the reward and control /healthz."""
        atexit.register(self.kill_all)  # last resort if the caller's finally never runs
        self.started_at = time.monotonic()
        self.session = Session(self.plan.run_dir)
        for spec in self.specs:
            if not spec.config_path.is_file():
                raise FileNotFoundError(f"{spec.config_path} is missing: write_configs(plan) before starting")
        for spec in self.specs:
            self.procs[spec.name] = spawn(spec, self.keep_fds)
            if spec.role in ("redis", "judge"):  # everyone talks to Redis; the reward service to the judge
                self._wait_ready(spec)
        for spec in self.specs:
            self._wait_ready(spec)

    def _wait_ready(self, spec: ServiceSpec) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not is_ready(spec):
            returncode = self.procs[spec.name].poll()
            if returncode is not None:
                self._reaped(spec)
                raise StackError(failure(spec, f"exited with code {returncode} while starting"))
            if time.monotonic() > deadline:
                raise StackError(failure(spec, f"was not ready after {self.ready_timeout_s:.0f}s"))
            time.sleep(0.1)

    def _reaped(self, spec: ServiceSpec) -> None:
        self.ended.add(spec.name)
        kill_group(self.procs[spec.name])  # a dead service's own children (verifier pool, ...) go too

    def end_line(self) -> None:
        self.terminal.end_line()

    def report(self, message: str) -> None:
        self.terminal.report(message)

    def show_progress(self, line: str | None) -> None:
        self.terminal.show_progress(line)

    @property
    def redis_restarts(self) -> list[float]:
        """When the private Redis was restarted (monotonic seconds)."""
        return self.restarts.times.get("redis", [])

    def poll(self) -> int | None:
        """None while the stack should run on; else its exit code (learner done: 0). A service that died is
        restarted here, within `supervision`'s budget."""
        for spec in self.specs:
            returncode = self.procs[spec.name].poll() if spec.name in self.procs else None
            if returncode is None or spec.name in self.ended:
                continue
            self._reaped(spec)
            left = sum(1 for s in self.specs if s.role == "rollout" and s.name not in self.ended)
            outcome = on_exit(spec, returncode, self.restarts, time.monotonic(), left)
            if outcome.message is not None:
                self.report(outcome.message)
            if outcome.action == "restart":
                self._restart(spec, returncode)
            elif outcome.action == "end":
                self.end_reason = outcome.reason
                return outcome.code
        return None

    def _restart(self, spec: ServiceSpec, returncode: int) -> None:
        """Spawn a dead service again from its config (Redis on its port and append-only file); the others
        reconnect or retry meanwhile, so nothing waits for it to be ready here."""
        try:  # a line in its log; a disk that cannot take it must not end the launcher
            with spec.log_path.open("a") as log:
                log.write(f"--- sparkrl up: exited with code {returncode}; restarted ---\n")
        except OSError as exc:
            self.report(f"warning: {spec.log_path}: {exc}")
        self.procs[spec.name] = spawn(spec, self.keep_fds)
        self.ended.discard(spec.name)

    def wait(self, poll_s: float = 0.5) -> int:
        """Supervise until the learner ends, a service fails, or Ctrl-C/SIGTERM; returns the exit code."""
        has_learner = any(s.role == "learner" for s in self.specs)
        try:
            while True:
                if has_learner:  # first: the last step's line before a service's end is reported
                    self.show_progress(self.progress())
                code = self.poll()
                if code is not None:
                    return code
                time.sleep(poll_s)
        except KeyboardInterrupt:
            self.report("interrupted: stopping the stack")
            return 130
        finally:
            self.end_line()

    def progress(self) -> str | None:
        """The progress line from the telemetry channel; None before the first step or without Redis."""
        if self.telemetry is None:
            self.telemetry = Telemetry(RedisBus(_quick(self.plan.settings)))
        settings = self.plan.settings
        try:
            learner, row = self.telemetry.learner(), self.telemetry.last_step()
            if self.session is not None:  # after --resume, the start before's status and rows are not ours
                learner, row = self.session.learner(learner), self.session.step(row)
                for said in self.session.commands(self.telemetry):
                    self.report(said)
            total = learner.max_steps if learner is not None else settings.learner.max_steps
            line = progress_line(row, total)  # its max_steps: where the data ends the run, if sooner
            if line is not None and self.started_at is not None and learner and learner.startup_s:
                self._say_startup(learner)
            if line is not None or self.started_at is None:
                return line
            workers = {w: s.state for w, s in self._own_workers().items()}
        except (BusError, redis.RedisError):
            return None
        state = learner.state if learner is not None else None
        elapsed = time.monotonic() - self.started_at
        return startup_line(elapsed, state, _op_state(), workers, settings.learner.startup_timeout_s)

    def _say_startup(self, learner: LearnerStatus) -> None:
        """At the first step: how long each service's start took (their heartbeats), said once, kept in
        RUN_DIR/startup.json for the summary."""
        assert self.telemetry is not None and self.started_at is not None
        workers = {w: s.startup_s for w, s in self._own_workers().items()}
        facts = startup_facts(time.monotonic() - self.started_at, learner.startup_s, workers)
        self.started_at = None  # said: the start-up is over
        self.report(startup_text(facts))
        if self.session is not None:
            self.session.started(facts)

    def _own_workers(self) -> dict[str, WorkerStatus]:
        assert self.telemetry is not None
        workers = self.telemetry.workers()
        return self.session.workers(workers) if self.session is not None else workers

    def shutdown(self) -> None:
        """SIGTERM tier by tier (plan.STOP_TIERS), each given `grace_s`; SIGKILL what is left."""
        try:
            for roles in STOP_TIERS:
                if "redis" in roles and self.procs:
                    self._keep_dead_letters()  # everyone that dead-letters has stopped; Redis still runs
                self._stop_tier([s for s in self.specs if s.role in roles and s.name in self.procs])
        except KeyboardInterrupt:
            self.report("interrupted again: killing every service")
        finally:
            self.kill_all()
            atexit.unregister(self.kill_all)
            if self.telemetry is not None:
                self.telemetry.bus.close()
            if self.end_reason is not None:
                record_end(self.plan.run_dir, self.end_reason)

    def _keep_dead_letters(self) -> None:
        """RUN_DIR/dead_letters.jsonl: what `sparkrl dead` and the summary read once the run is over."""
        bus = self.telemetry.bus if self.telemetry is not None else RedisBus(_quick(self.plan.settings))
        try:
            save_dead_letters(bus, self.plan.run_dir)
        except (BusError, redis.RedisError, OSError) as exc:
            if self.plan.private_redis:  # an external Redis keeps them: `sparkrl dead` reads them there
                self.report(f"warning: the dead letters were not saved to {self.plan.run_dir}: {exc}")
        finally:
            if self.telemetry is None:
                bus.close()

    def _stop_tier(self, specs: list[ServiceSpec]) -> None:
        for spec in specs:
            proc = self.procs[spec.name]
            if proc.poll() is None:
                # The leader only: it stops its own children in order (uvicorn closes the verifier pool);
                # under torchrun, rank 0 (sparkrl/torchrun.py).
                leader = (rank_zero(proc.pid) if is_torchrun(spec.command) else None) or proc.pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(leader, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for spec in specs:
            try:
                self.procs[spec.name].wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.report(f"{spec.name} did not stop within {self.grace_s:g}s: killing it")
            if spec.name not in self.ended:
                self._reaped(spec)

    def kill_all(self) -> None:
        """SIGKILL every service group still unreaped (the atexit and double-Ctrl-C path)."""
        for proc in self.procs.values():
            if proc.returncode is None:
                kill_group(proc)


def _op_state() -> OpState:
    """DeepSpeed's shared-memory op in the learner's extensions folder (processes.child_env's): torch holds
    a `lock` file there while it builds, and the built library stays beside it."""
    op = (
        Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cache_dir() / "torch_extensions")
        / "deepspeed_shm_comm"
    )
    if (op / "lock").exists():
        return "building"
    return "built" if any(op.glob("*.so")) else "missing"


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    # Unhandled, SIGTERM and SIGHUP (terminal closed) end Python without finally or atexit: orphans.
    # As KeyboardInterrupt they take the Ctrl-C path instead: an ordered shutdown.
    previous = {s: signal.signal(s, signal.default_int_handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_stack(
    cfg: SparkSettings,
    workers: int,
    private_redis: bool | None,
    preset_name: str | None,
    resume: bool = False,
    lock_fd: int | None = None,
) -> int:
    """Plan, write, spawn, supervise until the learner ends, shut down, summarize; the exit code.
    `lock_fd`: the run directory's lock, handed to every service (held until the last is gone).

    Main thread only: it turns SIGTERM/SIGHUP into KeyboardInterrupt for the duration.
    """
    plan = plan_stack(cfg, workers, private_redis, resume)
    if not plan.private_redis and (taken := _namespace_taken(plan)) is not None:
        print(f"error: {taken}; nothing was started", file=sys.stderr, flush=True)
        return 2
    write_configs(plan)
    print(header(plan, preset_name, workers), flush=True)
    stack = Stack(plan, keep_fds=() if lock_fd is None else (lock_fd,))
    return supervise(stack, stack.report, plan.run_dir)


def _namespace_taken(plan: StackPlan) -> str | None:
    """Why the run may not use its Redis namespace (another live run owns it), before anything is spawned;
    None when it may, or when Redis cannot be reached from here (the services say so then)."""
    try:
        with RedisBus(_quick(plan.settings)) as bus:
            return foreign_owner(bus, plan.settings.bus.run_id)
    except (BusError, redis.RedisError):
        return None


class Supervised(Protocol):
    def start(self) -> None: ...
    def wait(self) -> int: ...
    def shutdown(self) -> None: ...


def supervise(stack: Supervised, report: Callable[[str], None], run_dir: Path) -> int:
    """Start, wait, shut down whatever happened (Ctrl-C and SIGTERM included), then summarize and write
    the report: `sparkrl up` and `sparkrl up --ray` end the same way. The exit code."""
    with _signals_interrupt():
        try:
            stack.start()
            code = stack.wait()
        except StackError as exc:
            report(f"error: {exc}")
            code = 1
        except KeyboardInterrupt:
            code = 130
        finally:
            stack.shutdown()
    print(summarize(run_dir), flush=True)  # says the run's end even when its disk is full
    _write_report(run_dir, interrupted=code == 130)
    return code


def _write_report(run_dir: Path, interrupted: bool) -> None:
    """`sparkrl report RUN_DIR` at the end of every run that trained a step; after Ctrl-C it is only named
    (its charts take seconds, and an interrupted user is waiting for the prompt)."""
    if not (run_dir / "metrics.jsonl").is_file():
        return
    if interrupted:
        print(f"  report: `sparkrl report {run_dir}` writes it", flush=True)
        return
    try:
        from sparkrl.report import write_report

        print(f"  report: {write_report(run_dir)}", flush=True)
    except ImportError as exc:
        print(f"  report: not written ({exc}); install the `control` extra for `sparkrl report`", flush=True)
    except (ValueError, OSError) as exc:
        print(f"  report: not written: {exc}", flush=True)
