"""`sparkrl up`: plan the whole stack, write each service's resolved config, spawn, supervise, summarize.

The launcher resolves, writes, then spawns: `plan_stack` decides ports and every service's settings,
`write_configs` puts them in `RUN_DIR/config/`, and each service starts from its file alone
(`python -m sparkrl.cli <role> --preset RUN_DIR/config/<service>.yaml`), logging to `RUN_DIR/logs/`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
import redis

from sparkrl.run_report import progress_line, summarize, tail_bytes
from sparkrl.services.common.settings import SparkSettings, write_resolved

Role = Literal["redis", "reward", "learner", "rollout", "prompts"]
# Shutdown walks this backwards: producers stop before what they feed (the feeder and workers before the
# learner, workers before the reward service they call), and Redis, which everyone talks to, goes last.
START_ORDER: tuple[Role, ...] = ("redis", "reward", "learner", "rollout", "prompts")

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


@dataclass(frozen=True)
class ServiceSpec:
    """One process of the stack: the command that starts it from its written config, and its log."""

    name: str  # `reward`, `worker-0`, ...: file names and reports use it
    role: Role
    command: tuple[str, ...]
    config_path: Path
    config: SparkSettings | str  # the resolved tree, or (redis) the literal redis.conf text
    log_path: Path


@dataclass(frozen=True)
class StackPlan:
    """Everything `sparkrl up` will start, in start order, with the planned ports in `settings`."""

    run_dir: Path
    settings: SparkSettings
    services: tuple[ServiceSpec, ...]
    private_redis: bool


class StackError(RuntimeError):
    """A service failed to start or died; the message names it and quotes the end of its log."""


# ── plan and write ────────────────────────────────────────────────────────────────────────────────────


def _free_ports(count: int) -> list[int]:
    # Hold every socket open until all are bound, so the OS cannot hand out the same port twice.
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def _resolve_root(cfg: SparkSettings, private_redis: bool, run_dir: Path) -> SparkSettings:
    """The root tree with the launch decided: absolute run dir, private Redis URL, free ports.

    A port the user set (preset, environment, `--set`, or a resolved file) is kept; one left at its
    default is replaced by a free loopback port, so two runs on one machine never collide.
    """
    redis_port, reward_port, sync_port = _free_ports(3)
    root = cfg.model_copy(deep=True)
    root.run_dir = str(run_dir)
    if private_redis:
        root.bus.url = f"redis://127.0.0.1:{redis_port}/0"
    if "port" not in cfg.reward.model_fields_set or cfg.reward.port == 0:
        root.reward.port = reward_port
    # The launcher runs the reward service itself, so clients must call exactly where it binds.
    host = "127.0.0.1" if root.reward.host in ("0.0.0.0", "", "::") else root.reward.host
    root.reward.url = f"http://{host}:{root.reward.port}"
    if "port" not in cfg.learner.sync.model_fields_set:
        root.learner.sync.port = sync_port
    return root


def _redis_conf(url: str, data_dir: Path) -> str:
    port = url.rsplit(":", 1)[1].split("/")[0]
    # A private, throw-away bus: loopback only, no snapshots, no append-only file.
    return f'port {port}\nbind 127.0.0.1\nsave ""\nappendonly no\ndaemonize no\ndir {data_dir}\n'


def _service(run_dir: Path, name: str, role: Role, config: SparkSettings | str, *extra: str) -> ServiceSpec:
    if role == "redis":
        config_path = run_dir / "config" / "redis.conf"
        command: tuple[str, ...] = (shutil.which("redis-server") or "redis-server", str(config_path))
    else:
        config_path = run_dir / "config" / f"{name}.yaml"
        command = (sys.executable, "-m", "sparkrl.cli", role, "--preset", str(config_path), *extra)
    return ServiceSpec(name, role, command, config_path, config, run_dir / "logs" / f"{name}.log")


def plan_stack(
    cfg: SparkSettings, workers: int, private_redis: bool | None = None, resume: bool = False
) -> StackPlan:
    """Decide ports and each service's resolved settings; touches no file.

    `private_redis=None` starts a private `redis-server` exactly when no Redis URL was given; `resume`
    starts the learner from `RUN_DIR/checkpoints/latest`.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}: the learner trains on their groups")
    if private_redis is None:
        private_redis = "url" not in cfg.bus.model_fields_set
    run_dir = Path(cfg.run_dir).resolve()
    root = _resolve_root(cfg, private_redis, run_dir)
    services: list[ServiceSpec] = []
    if private_redis:
        services.append(_service(run_dir, "redis", "redis", _redis_conf(root.bus.url, run_dir / "redis")))
    services.append(_service(run_dir, "reward", "reward", root))
    services.append(_service(run_dir, "learner", "learner", root, *(["--resume"] if resume else [])))
    for index in range(workers):
        worker = root.model_copy(deep=True)
        worker.rollout.worker_id = f"worker-{index}"
        # The id is in the file (which alone reproduces the worker) and on the command line, for `ps`.
        services.append(
            _service(run_dir, f"worker-{index}", "rollout", worker, "--worker-id", f"worker-{index}")
        )
    services.append(_service(run_dir, "prompts", "prompts", root))
    return StackPlan(run_dir, root, tuple(services), private_redis)


def write_configs(plan: StackPlan) -> None:
    """Write every service's config (`RUN_DIR/config/<service>.yaml`, `redis.conf`) and the run's folders."""
    for spec in plan.services:
        if isinstance(spec.config, str):
            spec.config_path.parent.mkdir(parents=True, exist_ok=True)
            spec.config_path.write_text(spec.config)
        else:
            write_resolved(spec.config, spec.config_path)
    for folder in ("logs", "redis", "checkpoints"):
        (plan.run_dir / folder).mkdir(parents=True, exist_ok=True)


# ── processes ─────────────────────────────────────────────────────────────────────────────────────────


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the launcher itself is SIGKILLed (no finally, no atexit),
    # the kernel still sends the service SIGTERM, so it stops cleanly instead of running on as an orphan.
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _child_env() -> dict[str, str]:
    # The written file alone must define a service: SPARKRL_* variables would override it in the child
    # (environment beats preset), undoing e.g. the private Redis URL. The launcher already folded them in.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKRL_") or k == "SPARKRL_LOG_LEVEL"}
    env["PYTHONUNBUFFERED"] = "1"  # log lines reach the file (and a failure report) as they happen
    return env


def _spawn(spec: ServiceSpec) -> subprocess.Popen[bytes]:
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    with spec.log_path.open("ab") as log:
        # Own session (so own process group): a terminal's Ctrl-C reaches only the launcher, which then
        # stops services in order, and a SIGKILL to the group also takes a service's own children.
        return subprocess.Popen(
            spec.command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_child_env(),
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    # Safe only while the leader is unreaped or was reaped just now: until then the id cannot be reused.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def logtail_bytes(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log, indented for a report."""
    text = tail_bytes(path, 16_384).decode(errors="replace")
    return "\n".join("    " + line for line in text.splitlines()[-lines:]) or "    (empty log)"


def _failure(spec: ServiceSpec, what: str) -> str:
    return f"{spec.name} {what}; last lines of {spec.log_path}:\n{logtail_bytes(spec.log_path)}"


def _is_ready(role: Role, settings: SparkSettings) -> bool:
    """Redis answers PING, the reward service GET /healthz; the others have no probe."""
    if role == "reward":
        try:
            return httpx.get(f"{settings.reward.url}/healthz", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False
    if role != "redis":
        return True
    client = redis.Redis.from_url(settings.bus.url, socket_timeout=1, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError):
        return False
    finally:
        client.close()


class Stack:
    """The running services: start in order and wait until each is ready, supervise, stop in reverse.

    Call from the main thread: a service's parent-death signal fires when the thread that spawned it ends.
    """

    plan: StackPlan
    specs: tuple[ServiceSpec, ...]
    ready_timeout_s: float
    grace_s: float
    procs: dict[str, subprocess.Popen[bytes]]
    ended: set[str]
    last_line: str | None  # the progress line shown last
    line_open: bool  # a terminal progress line still waits for its newline

    def __init__(
        self,
        plan: StackPlan,
        services: Sequence[str] | None = None,
        ready_timeout_s: float = 120.0,
        grace_s: float = 15.0,
    ) -> None:
        """`services` picks a subset by name (`worker-1`) or role (`rollout`); None: all of the plan."""
        wanted = set(services) if services is not None else {s.name for s in plan.services}
        unknown = wanted - {s.name for s in plan.services} - {s.role for s in plan.services}
        if unknown:
            raise ValueError(f"not in the plan: {', '.join(sorted(unknown))}")
        self.plan = plan
        self.specs = tuple(s for s in plan.services if s.name in wanted or s.role in wanted)
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.procs = {}
        self.ended = set()
        self.last_line = None
        self.line_open = False

    def start(self) -> None:
        """Spawn each service from its written config, waiting for Redis PING and reward /healthz."""
        atexit.register(self.kill_all)  # last resort if the caller's finally never runs
        for spec in self.specs:
            if not spec.config_path.is_file():
                raise FileNotFoundError(f"{spec.config_path} is missing: write_configs(plan) before starting")
            self.procs[spec.name] = _spawn(spec)
            self._wait_ready(spec)

    def _wait_ready(self, spec: ServiceSpec) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not _is_ready(spec.role, self.plan.settings):
            returncode = self.procs[spec.name].poll()
            if returncode is not None:
                self._reaped(spec)
                raise StackError(_failure(spec, f"exited with code {returncode} while starting"))
            if time.monotonic() > deadline:
                raise StackError(_failure(spec, f"was not ready after {self.ready_timeout_s:.0f}s"))
            time.sleep(0.1)

    def _reaped(self, spec: ServiceSpec) -> None:
        self.ended.add(spec.name)
        _kill_group(self.procs[spec.name])  # a dead service's own children (verifier pool, ...) go too

    def end_line(self) -> None:
        if self.line_open:  # a terminal progress line gets its newline before anything else prints
            print(flush=True)
            self.line_open = False

    def report(self, message: str) -> None:
        self.end_line()
        print(message, file=sys.stderr, flush=True)

    def show_progress(self, line: str | None) -> None:
        """Rewrite one line in place on a terminal; elsewhere (logs, CI) print each new line once."""
        if line is None or line == self.last_line:
            return
        self.last_line = line
        self.line_open = sys.stdout.isatty()
        print(f"\r{line}\x1b[K" if self.line_open else line, end="" if self.line_open else "\n", flush=True)

    def poll(self) -> int | None:
        """None while the stack should run on; else its exit code (learner done: 0)."""
        for spec in self.specs:
            returncode = self.procs[spec.name].poll() if spec.name in self.procs else None
            if returncode is None or spec.name in self.ended:
                continue
            self._reaped(spec)
            if spec.role == "learner" and returncode == 0:
                self.report("learner finished")
                return 0
            if spec.role == "prompts" and returncode == 0:
                continue  # the feeder exits once the dataset is in the stream
            text = _failure(spec, f"exited with code {returncode}")
            workers_left = [s for s in self.specs if s.role == "rollout" and s.name not in self.ended]
            if spec.role == "rollout" and workers_left:
                self.report(f"warning: {text}\n(the fleet is elastic; workers left: {len(workers_left)})")
                continue
            self.report(f"error: {text}" + ("\nno rollout worker is left" if spec.role == "rollout" else ""))
            # A signal death (-N) becomes 128+N, as a shell reports it.
            return (returncode if returncode > 0 else 128 - returncode) if spec.role == "learner" else 1
        return None

    def wait(self, poll_s: float = 0.5) -> int:
        """Supervise until the learner ends, a service fails, or Ctrl-C/SIGTERM; returns the exit code."""
        has_learner = any(s.role == "learner" for s in self.specs)
        max_steps = self.plan.settings.learner.max_steps
        try:
            while True:
                code = self.poll()
                if has_learner:
                    self.show_progress(progress_line(self.plan.run_dir, max_steps))
                if code is not None:
                    return code
                time.sleep(poll_s)
        except KeyboardInterrupt:
            self.report("interrupted: stopping the stack")
            return 130
        finally:
            self.end_line()

    def shutdown(self) -> None:
        """SIGTERM tier by tier in reverse start order, each given `grace_s`; SIGKILL what is left."""
        try:
            for role in reversed(START_ORDER):
                self._stop_tier([s for s in self.specs if s.role == role and s.name in self.procs])
        except KeyboardInterrupt:
            self.report("interrupted again: killing every service")
        finally:
            self.kill_all()
            atexit.unregister(self.kill_all)

    def _stop_tier(self, specs: list[ServiceSpec]) -> None:
        for spec in specs:
            if self.procs[spec.name].poll() is None:
                # The leader only: it stops its own children in order (uvicorn closes the verifier pool).
                self.procs[spec.name].send_signal(signal.SIGTERM)
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
                _kill_group(proc)


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
) -> int:
    """Plan, write, spawn, supervise until the learner ends, shut down, summarize; the exit code.

    Main thread only: it turns SIGTERM/SIGHUP into KeyboardInterrupt for the duration.
    """
    plan = plan_stack(cfg, workers, private_redis, resume)
    write_configs(plan)
    s = plan.settings
    print(
        f"sparkrl up: preset {preset_name or '(defaults)'}, run dir {plan.run_dir}, {workers} workers\n"
        f"  redis {s.bus.url}{' (private)' if plan.private_redis else ''} | reward {s.reward.url}"
        f" | weight sync {s.learner.sync.host}:{s.learner.sync.port} | logs {plan.run_dir / 'logs'}/",
        flush=True,
    )
    stack = Stack(plan)
    with _signals_interrupt():
        try:
            stack.start()
            code = stack.wait()
        except StackError as exc:
            stack.report(f"error: {exc}")
            code = 1
        except KeyboardInterrupt:
            code = 130
        finally:
            stack.shutdown()
    print(summarize(plan.run_dir), flush=True)
    return code
