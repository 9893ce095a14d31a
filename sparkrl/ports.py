"""The ports `sparkrl up` will bind, checked before anything starts (the preflight calls `problems`).

A port a setting names (control.port, reward.port, sync.port, sync.http_port, learner.metrics.port,
rollout.metrics.port) is kept as given by the plan (`plan.py`), so it must be free on its host: a busy one
is refused with the setting, the port and, when this user may see it, the process that holds it. Ports
left at their default or 0 are chosen free by the plan (`free_ports`) and need no check; so is the private
Redis's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path

from sparkrl.services.common.settings import SparkSettings

_LISTEN = "0A"  # a TCP socket's state in /proc/net/tcp: listening
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000  # planned ports are drawn from here up to the kernel's ephemeral range


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free on `host` now, drawn below the kernel's ephemeral range.

    A port the OS hands out for `bind(0)` comes from the ephemeral range, which every outgoing connection
    (a Redis client, an HTTP request) also draws from: in the seconds between the plan and a service's
    bind, a client could take it ("Address already in use" at the learner's start). Below that range only
    a listener can take a port. Each socket is held until all are bound, so no port is given twice.
    Where the range leaves no room below it, the OS picks (bind 0)."""
    low = _ephemeral_low()
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        candidates = random.sample(range(_LOWEST, low), k=low - _LOWEST) if low - _LOWEST > 4 * count else []
        for port in candidates:
            if len(ports) == count:
                break
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind((host, port))
            except OSError:
                continue
            ports.append(port)
        while len(ports) < count:
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


@dataclass(frozen=True)
class Bind:
    """A port a setting names, and the host the service binds it on."""

    setting: str
    host: str
    port: int


def given_ports(cfg: SparkSettings) -> list[Bind]:
    """The ports the user set, which the plan keeps as they are (the others it picks free)."""
    binds = []
    for section, name in ((cfg.control, "control"), (cfg.reward, "reward")):
        if "port" in section.model_fields_set and section.port != 0:
            binds.append(Bind(f"{name}.port", section.host, section.port))
    if "port" in cfg.sync.model_fields_set:
        binds.append(Bind("sync.port", cfg.sync.host, cfg.sync.port))
    if "http_port" in cfg.sync.model_fields_set and cfg.sync.http_port != 0:
        binds.append(Bind("sync.http_port", cfg.sync.host, cfg.sync.http_port))
    for endpoint, name in ((cfg.learner.metrics, "learner"), (cfg.rollout.metrics, "rollout")):
        if endpoint.port != 0:  # 0 is the default here: `sparkrl up` picks one per service
            binds.append(Bind(f"{name}.metrics.port", endpoint.host, endpoint.port))
    return binds


def problems(cfg: SparkSettings) -> list[tuple[str, str]]:
    """(setting, what is wrong and the fix) for each port given twice or taken already."""
    found: list[tuple[str, str]] = []
    first: dict[int, str] = {}
    for bind in given_ports(cfg):
        if bind.port in first:
            found.append((bind.setting, f"port {bind.port} is {first[bind.port]} too: give each its own"))
            continue
        first[bind.port] = bind.setting
        why = bind_error(bind.host, bind.port)
        if why is not None:
            found.append((bind.setting, f"{why}: {_fix(bind)}"))
    return found


def _fix(bind: Bind) -> str:
    return f"stop that process, or set another {bind.setting} (0 or unset: `sparkrl up` picks a free one)"


def bind_error(host: str, port: int) -> str | None:
    """Why a server could not bind `host:port` now (None: it could), with the holder when it is found."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        return f"host {host!r} does not resolve ({exc.strerror})"
    with socket.socket(family, kind, proto) as sock:
        # As the servers bind (uvicorn, the TCPStore): a port held only by closed connections is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is taken by {holder(port) or 'another process'}"
            if exc.errno == errno.EACCES:
                return f"port {port} needs privileges to bind (ports below 1024 do)"
            return None  # not a port problem (an address not on this machine): the service says it
    return None


def holder(port: int) -> str | None:
    """`pid 4242 (python -m http.server 8200)` listening on `port`, when /proc shows it to this user."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):  # gone meanwhile, or another user's: not readable
            for fd in fd_dir.iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return _describe_pid(int(fd_dir.parent.name))
    return None


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == _LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                    inodes.add(inode)
    return inodes


def _describe_pid(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    command = " ".join(part.decode(errors="replace") for part in argv if part)
    return f"pid {pid} ({command[:120]})" if command else f"pid {pid}"
