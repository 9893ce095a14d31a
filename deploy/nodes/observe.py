"""What the smoke reads off a run and off the test bed: which process listens where on which node, the
step rows and broadcasts the learner wrote, the audit trail, and the watcher's lines."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from netns import Node, pids

# Command lines (as /proc says them) → the role they play; the first match wins.
ROLES = (
    (r"torch\.distributed\.run|bin/torchrun", "torchrun agent"),
    (r"redis-server", "redis"),
    (r"sparkrl(?:\.cli)? reward", "reward"),
    (r"sparkrl(?:\.cli)? control", "control"),
    (r"sparkrl(?:\.cli)? prompts", "feeder"),
    (r"sparkrl(?:\.cli)? rollout", "rollout worker"),
    (r"sparkrl(?:\.cli)? learner", "learner rank"),
    (r"sparkrl(?:\.cli)? up", "sparkrl up (driver)"),
    (r"_dp_step\.py", "one-step learner"),
    (r"ServiceActor", "actor"),  # the learner or a worker: told apart by the worker ids' pids
    (r"ProxyActor", "Serve proxy (reward)"),
    (r"ServeReplica", "Serve replica (reward)"),
    (r"ServeController", "Serve controller"),
    (r"gcs_server", "Ray GCS"),
    (r"raylet", "Ray raylet"),
)
# Whose listeners must bind the node's address: the processes sparkrl's commands start (torchrun's agent
# and Ray's own processes are those projects' choice, reported apart).
# Ray's own core-worker ports in an actor's process (`ray start --min-worker-port/--max-worker-port`).
RAY_WORKER_PORTS = (10002, 10999)
OURS = (
    "redis",
    "reward",
    "control",
    "feeder",
    "rollout worker",
    "learner rank",
    "one-step learner",
    "learner",
)


class SmokeFailed(AssertionError):
    """A check of the smoke failed; the message says which and what was seen."""


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def role_of(pid: int) -> str | None:
    line = cmdline(pid)
    return next((role for pattern, role in ROLES if re.search(pattern, line)), None)


@dataclass(frozen=True)
class Listener:
    node: str
    address: str
    port: int
    pid: int
    role: str | None


def listeners(node: Node) -> list[Listener]:
    """Every TCP listener in the node's namespace, with the process holding it."""
    out = subprocess.run(
        ["ip", "netns", "exec", node.name, "ss", "-ltnpH"], capture_output=True, text=True, check=False
    ).stdout
    found = []
    for row in out.splitlines():
        fields = row.split()
        if len(fields) < 6:
            continue
        address, _, port = fields[3].rpartition(":")
        address = address.strip("[]").removeprefix("::ffff:")
        for pid in {int(p) for p in re.findall(r"pid=(\d+)", row)}:
            found.append(Listener(node.name, address, int(port), pid, role_of(pid)))
    return found


def wildcard(address: str) -> bool:
    return address in ("0.0.0.0", "*", "::", "")


def placement(nodes: tuple[Node, ...], names: dict[int, str]) -> tuple[list[str], list[str], list[str]]:
    """(one line per node: its address, each process of note and where it listens; the listeners of ours
    on every interface, which must be none; the others' there, said apart). `names`: pid → a better name
    (the actors' roles); `ignore`d ports are Ray's own in our actors' processes."""
    lines, ours, others = [], [], []
    for node in nodes:
        seen: dict[int, list[str]] = {pid: [] for pid in pids(node) if (names.get(pid) or role_of(pid))}
        for lis in listeners(node):
            role = names.get(lis.pid) or lis.role or cmdline(lis.pid)[:60]
            if lis.pid in seen:
                seen[lis.pid].append(f"{lis.address}:{lis.port}")
            if wildcard(lis.address):
                said = f"{node.name}: {role} (pid {lis.pid}) on {lis.address}:{lis.port}"
                mine = (
                    role.split(" worker-")[0] in OURS
                    and not RAY_WORKER_PORTS[0] <= lis.port <= RAY_WORKER_PORTS[1]
                )
                (ours if mine else others).append(said)
        parts = []
        for pid, where in sorted(seen.items(), key=lambda item: names.get(item[0]) or role_of(item[0]) or ""):
            role = names.get(pid) or role_of(pid)
            parts.append(f"{role} (pid {pid}{': ' + ', '.join(sorted(set(where))) if where else ''})")
        lines.append(f"{node.name} {node.address}: " + "; ".join(parts))
    return lines, ours, others


def jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_times(run_dir: Path) -> list[tuple[int, float]]:
    return [(row["step"], row["time"]) for row in jsonl(run_dir / "metrics.jsonl")]


def trained_once(run_dir: Path) -> tuple[int, int]:
    """(steps, groups) of the audit trail, after checking every group was trained exactly once, the steps
    run 1..N and the latest checkpoint agrees (a later record of a step supersedes a redone one's)."""
    steps: dict[int, list[str]] = {}
    for record in jsonl(run_dir / "trained_groups.jsonl"):
        steps[record["step"]] = record["group_ids"]
    trained = [gid for step in sorted(steps) for gid in steps[step]]
    if sorted(steps) != list(range(1, len(steps) + 1)):
        raise SmokeFailed(f"{run_dir}/trained_groups.jsonl: steps {sorted(steps)} are not 1..{len(steps)}")
    if len(trained) != len(set(trained)):
        raise SmokeFailed(f"{run_dir}: {len(trained) - len(set(trained))} groups were trained twice")
    latest = run_dir / "checkpoints" / "latest"
    state = json.loads((latest / "trainer_state.json").read_text())
    if (state["step"], state["groups_trained"]) != (len(steps), len(trained)):
        raise SmokeFailed(
            f"{latest}: step {state['step']}, {state['groups_trained']} groups; the trail disagrees"
        )
    return len(steps), len(trained)


@dataclass
class Watch:
    """The watcher's lines (deploy/nodes/watch.py on node-a), read on a thread; the newest kept."""

    log: Path
    lines: list[dict] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def follow(self, stream: object) -> None:
        thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        thread.start()

    def _read(self, stream: object) -> None:
        with self.log.open("a") as out:
            for raw in stream:  # type: ignore[attr-defined]
                out.write(raw.decode(errors="replace"))
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                with self._lock:
                    self.lines.append(line)

    def last(self) -> dict:
        with self._lock:
            return next((line for line in reversed(self.lines) if "error" not in line), {})

    def until(
        self, what: str, test: Callable[[dict], object], timeout_s: float, alive: Callable[[], None]
    ) -> float:
        """Wait until the newest line passes `test` (`alive` raises when the run died); when, unix time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive()
            line = self.last()
            if line and test(line):
                return float(line["t"])
            time.sleep(0.2)
        raise SmokeFailed(f"timed out after {timeout_s:.0f}s waiting for {what}; last seen: {self.last()}")
