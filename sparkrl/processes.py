"""The launcher's processes: how a service is spawned (its own session, its log, an environment that
leaves its written config in charge, SIGTERM when the launcher dies), killed with its children, and
probed for readiness."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

import httpx
import redis

from sparkrl.plan import ServiceSpec
from sparkrl.services.common.paths import cache_dir

_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
_DIST_ENV += ("GLOO_SOCKET_IFNAME",)
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the launcher itself is SIGKILLed (no finally, no atexit),
    # the kernel still sends the service SIGTERM, so it stops cleanly instead of running on as an orphan.
    # Everything a service writes into the run (logs, samples, checkpoints, Redis's append-only file) is
    # its user's alone: files 0600, folders 0700.
    os.umask(0o077)
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def child_env() -> dict[str, str]:
    # The written file alone must define a service: SPARKRL_* variables would override it in the child
    # (environment beats preset), undoing e.g. the private Redis URL. The launcher already folded them in.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKRL_") or k == "SPARKRL_LOG_LEVEL"}
    # A launcher started inside a torch.distributed job (or a process that ran one) must not hand its
    # rendezvous to the learner: it would bind the same MASTER_PORT (EADDRINUSE) or join the wrong world.
    for name in _DIST_ENV:
        env.pop(name, None)
    env["PYTHONUNBUFFERED"] = "1"  # log lines reach the file (and a failure report) as they happen
    # DeepSpeed's compiled op lives in sparkrl's cache (built once, whatever the working directory).
    env.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir() / "torch_extensions"))
    return env


def spawn(spec: ServiceSpec, keep_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """Start `spec`'s service. `keep_fds`: descriptors it inherits (the run directory's lock, held until
    the last service is gone)."""
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    with spec.log_path.open("ab") as log:
        # Own session (so own process group): a terminal's Ctrl-C reaches only the launcher, which then
        # stops services in order, and a SIGKILL to the group also takes a service's own children.
        return subprocess.Popen(
            spec.command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env() | dict(spec.env),
            start_new_session=True,
            preexec_fn=_die_with_parent,
            pass_fds=keep_fds,
        )


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    # Safe only while the leader is unreaped or was reaped just now: until then the id cannot be reused.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def answers_healthz(url: str, timeout_s: float = 1.0, route: str = "healthz") -> bool:
    """Whether the service at `url` answers GET /healthz (or `route`) with 200 (not answering at all:
    False)."""
    try:
        return httpx.get(f"{url}/{route}", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def is_ready(spec: ServiceSpec) -> bool:
    """The spec's readiness probe (plan.py decides it): Redis answers PING, a /healthz answers 200, or
    none (started is ready)."""
    if spec.ready is None:
        return True
    kind, url = spec.ready
    if kind in ("healthz", "health"):  # ours, and vLLM's server (a local judge)
        return answers_healthz(url, route=kind)
    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError):
        return False
    finally:
        client.close()
