"""One owner per run: the learner claims its bus namespace (a lease in Redis, renewed by a thread of its
own) and fences its run directory with the claim's generation (`RUN_DIR/owner.json`).

- A learner of another run is refused while the lease lives (`NamespaceOwned`, naming the owner), and so is
  `sparkrl up` before it spawns anything; workers and feeders given a run id check too. Two runs sharing a
  Redis and a namespace would take each other's prompts and groups.
- A learner of the same run (restarted by supervision, resumed) takes the lease over at once, under a new
  generation, and writes that generation to `owner.json`. An earlier learner still running (an orphan of a
  killed launcher) finds another generation there before it writes a checkpoint, `latest` or `ended.json`,
  and writes nothing (`Fenced`).
- A learner that finds its lease taken by another run stops (`Lease.lost`, its stop set).
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path

from pydantic import ValidationError

from sparkrl.proto.run_files import RunOwner
from sparkrl.services.common.bus import BusError, RedisBus

log = logging.getLogger("sparkrl.ownership")

RUN_ID_FILE = "run-id"  # the run's identity: made on a fresh start, kept by a resume
FENCE_FILE = "owner.json"  # the generation that may write into the run directory


class NamespaceOwned(RuntimeError):
    """Another run owns the namespace; the message names it and the fix."""


class Fenced(RuntimeError):
    """A newer learner of this run holds the run directory: this one may write nothing into it."""


def run_id_of(run_dir: Path, fresh: bool) -> str:
    """The run's id from `RUN_DIR/run-id`; a fresh run (or a directory without one) gets a new one."""
    path = run_dir / RUN_ID_FILE
    if not fresh and path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(8)
    _write_private(path, run_id + "\n")
    return run_id


def describe(owner: RunOwner) -> str:
    """`run 3f2a… (learner pid 42 on host h, run dir /runs/a) since 2026-12-06 12:00:03`."""
    since = datetime.datetime.fromtimestamp(owner.since).isoformat(sep=" ", timespec="seconds")
    return (
        f"run {owner.run_id} (learner pid {owner.pid} on host {owner.host}, run dir {owner.run_dir}, "
        f"generation {owner.generation}) since {since}"
    )


def read_owner(raw: str | None) -> RunOwner | None:
    if not raw:
        return None
    try:
        return RunOwner.model_validate_json(raw)
    except (ValidationError, ValueError):
        return None


def foreign_owner(bus: RedisBus, run_id: str | None) -> str | None:
    """Why `run_id` may not use the bus's namespace (another run owns it), or None. Nobody owning it (the
    learner is not up yet) is fine."""
    raw = bus.owners.current()
    if raw is None:
        return None
    owner = read_owner(raw)
    if owner is not None and owner.run_id == run_id:
        return None
    who = describe(owner) if owner is not None else f"a record this version cannot read ({raw[:200]!r})"
    return (
        f"namespace {bus.settings.namespace!r} on Redis {bus.url} is owned by {who}: two runs on one "
        "namespace take each other's prompts and groups. Give this run another bus.namespace (or its own "
        f"Redis), or stop that run; a learner that died frees it {bus.settings.owner_ttl_s:g} s after "
        "its last renewal (bus.owner_ttl_s)"
    )


def refuse_foreign_owner(bus: RedisBus, run_id: str | None, who: str) -> None:
    """For a worker or feeder with a run id: raise `NamespaceOwned` when another run owns the namespace
    (without a run id, it cannot tell, and checks nothing)."""
    if run_id is not None and (why := foreign_owner(bus, run_id)) is not None:
        raise NamespaceOwned(f"{who} of run {run_id} refused: {why}")


class Lease(threading.Thread):
    """The learner's hold on its namespace: claimed at start, renewed every third of `bus.owner_ttl_s`,
    released at a clean end. `lost` says why it was lost (then `stop` is set)."""

    bus: RedisBus
    owner: RunOwner  # ours, with the generation the claim got
    record: str  # as Redis stores it
    stop: threading.Event
    lost: str | None
    _done: threading.Event

    def __init__(self, bus: RedisBus, owner: RunOwner, record: str, stop: threading.Event) -> None:
        super().__init__(name="owner-lease", daemon=True)
        self.bus, self.owner, self.record, self.stop = bus, owner, record, stop
        self.lost, self._done = None, threading.Event()

    @classmethod
    def claim(cls, bus: RedisBus, run_id: str, run_dir: Path, stop: threading.Event) -> Lease:
        """Take the namespace for `run_id` and fence `run_dir` with the claim's generation; raises
        `NamespaceOwned` while another run's lease lives."""
        mine = RunOwner(
            run_id=run_id, run_dir=str(run_dir), host=socket.gethostname(), pid=os.getpid(), since=time.time()
        )
        ttl_s = bus.settings.owner_ttl_s
        claim = bus.owners.claim(run_id, mine.model_dump_json(exclude={"generation"}), ttl_s)
        if not claim.held:
            raise NamespaceOwned(foreign_owner(bus, run_id) or f"namespace owned by {claim.record!r}")
        owner = RunOwner.model_validate_json(claim.record)
        _write_private(run_dir / FENCE_FILE, owner.model_dump_json() + "\n")
        log.info("this learner owns namespace %r: %s", bus.settings.namespace, describe(owner))
        return cls(bus, owner, claim.record, stop)

    def run(self) -> None:
        ttl_s = self.bus.settings.owner_ttl_s
        while not self._done.wait(ttl_s / 3):
            try:
                claim = self.bus.owners.renew(self.record, self.owner.generation, ttl_s)
            except BusError as exc:  # the bus rides out what it can; the next renewal tries again
                log.warning("could not renew the namespace lease: %s", exc)
                continue
            if not claim.held:
                other = read_owner(claim.record)
                self.lost = (
                    f"another learner took namespace {self.bus.settings.namespace!r}: "
                    f"{describe(other) if other else 'its record is unreadable'}; this one stops"
                )
                log.error("%s", self.lost)
                self.stop.set()
                return

    def release(self) -> None:
        """At the end: stop renewing, and free the namespace if it is still ours (best effort)."""
        self._done.set()
        if self.lost is None:
            try:
                self.bus.owners.release(self.record)
            except BusError as exc:
                log.warning("could not release the namespace lease (it expires by itself): %s", exc)


class Fence:
    """The run directory's fence: this learner's claim against `RUN_DIR/owner.json`."""

    def __init__(self, run_dir: Path, owner: RunOwner) -> None:
        self.path, self.owner = run_dir / FENCE_FILE, owner

    def check(self, what: str) -> None:
        """Raise `Fenced` when a newer learner of this run holds the directory (before writing `what`)."""
        try:
            there = read_owner(self.path.read_text())
        except OSError:
            there = None
        if there != self.owner:
            holder = describe(there) if there is not None else "no readable owner.json"
            raise Fenced(
                f"not writing {what}: {self.path} names {holder}, not this learner (generation "
                f"{self.owner.generation}); a newer learner holds the run"
            )


def _write_private(path: Path, content: str) -> None:
    """Write `content` whole (temp file, rename), readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(content)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
