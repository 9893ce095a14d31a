"""The Ray layout across the bed, as docs/deployment.md types it, and two faults of the network's kind:
node-c cut off (its cable pulled at the switch, every process left running) and node-b's every process
SIGKILLed (a machine that dies), its Ray started again as a machine that comes back does."""

from __future__ import annotations

import itertools
import json
import re
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from netns import pids, signal_node
from observe import SmokeFailed, Watch, jsonl, placement, role_of, step_times, trained_once
from runner import Smoke, alive, say, tail

PART = "Ray"
STEPS_BEFORE = 3  # steps trained before the first fault
STEPS_DURING = 3  # steps trained with node-c cut off, after the learner dropped its worker
STEPS_AFTER = 3  # steps after the last worker came back, before the stop
# The partition lasts at least this: past sync.timeout_s, so the cut-off worker's Redis calls and heartbeat
# time out too, and well under the ~1 min in which Ray's GCS would declare node-c dead (its health checks
# time out one by one, 5 in a row).
PARTITION_S = 20.0


@dataclass
class Run:
    """What the faults need: the run's directory, the `up` chunk, the watcher, the timeout in force."""

    s: Smoke
    run_dir: Path
    up: subprocess.Popen[bytes]
    watch: Watch
    timeout_s: float  # sync.timeout_s: no step may stall longer

    def alive(self) -> None:
        alive(self.up, "sparkrl up --ray", self.s.log("ray-up"))
        said = self.s.log("ray-up").read_text(errors="replace")
        if "not schedulable yet" in said:  # no node offers what an actor asks: it would wait forever
            raise SmokeFailed(next(line for line in said.splitlines() if "not schedulable yet" in line))

    def step(self) -> int:
        times = step_times(self.run_dir)
        return times[-1][0] if times else 0

    def wait_steps(self, what: str, steps: int, timeout_s: float = 240) -> float:
        target = self.step() + steps
        return self.watch.until(
            what, lambda w: (w.get("learner") or {}).get("step", 0) >= target, timeout_s, self.alive
        )

    def worker_on(self, node: str) -> str | None:
        """The live worker whose process is on `node` (its id ends in its pid: `worker-1.4242`)."""
        on = set(pids(self.s.bed.node(node)))
        for wid in self.watch.last().get("workers", {}):
            pid = wid.rsplit(".", 1)[-1]
            if pid.isdigit() and int(pid) in on:
                return wid
        return None

    def first_sync(self, test: object, after: float, what: str, timeout_s: float = 120) -> float:
        """When (unix time, as seen here) the learner first wrote a broadcast passing `test`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.alive()
            for event in jsonl(self.run_dir / "weights.jsonl"):
                if event["announced_at"] >= after and test(event):  # type: ignore[operator]
                    return time.time()
            time.sleep(0.2)
        raise SmokeFailed(
            f"no broadcast {what} within {timeout_s:.0f}s:\n{tail(self.run_dir / 'weights.jsonl', 5)}"
        )

    def holds_current(self, worker: str | None, node: str) -> bool:
        w = self.watch.last()
        wid = worker or self.worker_on(node)
        held = (w.get("workers", {}).get(wid or "") or {}).get("version")
        return wid is not None and held is not None and held == w.get("announced")


def stalls(run_dir: Path, since: float, until: float, before: float) -> dict:
    """The steps written in [since, until] (and the one after): the longest gap between two, the longest
    the learner waited for the fleet in one (`time/wait_fleet_s`, bounded by sync.timeout_s), and the time
    lost against the median gap before `before`."""
    rows = jsonl(run_dir / "metrics.jsonl")
    gaps = [(b["time"], b["time"] - a["time"], b["metrics"]) for a, b in itertools.pairwise(rows)]
    usual = statistics.median([g for t, g, _ in gaps if t < before] or [0.0])
    later = [i for i, (t, _, _) in enumerate(gaps) if t > until]
    window = [gap for i, gap in enumerate(gaps) if since <= gap[0] <= until or (later and i == later[0])]
    return {
        "longest_step_gap_s": round(max((g for _, g, _ in window), default=0.0), 2),
        "longest_fleet_wait_s": round(
            max((m.get("time/wait_fleet_s", 0.0) for _, _, m in window), default=0.0), 2
        ),
        "usual_step_gap_s": round(usual, 2),
        "time_lost_s": round(sum(max(0.0, g - usual) for _, g, _ in window), 1),
        "steps_during": len(window),
    }


def partition(r: Run) -> dict:
    worker = r.worker_on("node-c")
    if worker is None:
        raise SmokeFailed(f"no worker on node-c before the partition: {r.watch.last()}")
    cut = time.time()
    r.s.bed.cut("node-c")
    say(f"node-c cut off (bridge port down); its worker {worker} still runs")
    dropped = r.first_sync(lambda e: worker in e["dropped"], cut, f"dropping {worker}")
    say(f"the learner dropped {worker} from the broadcast {dropped - cut:.1f} s after the cut")
    r.wait_steps("steps with node-c cut off", STEPS_DURING)
    while time.time() - cut < PARTITION_S:
        r.alive()
        time.sleep(0.5)
    mended = time.time()
    r.s.bed.mend("node-c")
    say("node-c back on the bridge")
    caught = r.watch.until(
        "node-c's worker to hold the current version", lambda w: r.holds_current(None, "node-c"), 180, r.alive
    )
    back = r.first_sync(lambda e: worker in e["acknowledged"], mended, f"acknowledged by {worker}")
    say(
        f"{worker} holds the current version {caught - mended:.1f} s after the link came back (over HTTP), "
        f"back in the broadcast after {back - mended:.1f} s (a dropped straggler sits out 2 × sync.timeout_s)"
    )
    return {
        "worker": worker,
        "cut_s": round(mended - cut, 1),
        "dropped_after_s": round(dropped - cut, 1),
        "caught_up_after_s": round(caught - mended, 1),
        "back_in_broadcast_after_s": round(back - mended, 1),
        "same_worker_rejoined": r.worker_on("node-c") == worker,
    } | stalls(r.run_dir, cut, back, before=cut)


def machine_dies(r: Run, hide: list[Path]) -> dict:
    worker = r.worker_on("node-b")
    if worker is None:
        raise SmokeFailed(f"no worker on node-b before the kill: {r.watch.last()}")
    killed_at = time.time()
    killed = signal_node(r.s.bed.node("node-b"), signal.SIGKILL)
    say(f"node-b: SIGKILL to all {len(killed)} processes (its raylet and worker {worker} among them)")
    r.wait_steps("a step without node-b", 1)
    # The machine comes back: its Ray started again, the same command; Ray restarts the actor on it.
    r.s.start(PART, "B and C", "ray start", on="B", label="ray-node-b-again", hide=hide)
    restarted = r.watch.until(
        "Ray to restart node-b's worker",
        lambda w: (r.worker_on("node-b") or worker) != worker,
        240,
        r.alive,
    )
    new = r.worker_on("node-b")
    caught = r.watch.until(
        f"{new} to hold the current version", lambda w: r.holds_current(new, "node-b"), 180, r.alive
    )
    # Ray's part: its GCS declares node-b dead (health checks refused in a row), then restarts the actor
    # on the node offering `rollout` again; the rest is the new process' imports and the model.
    # Not session_latest: that link names /tmp/ray/… as node-a sees its /tmp, another directory from here.
    sessions = sorted((r.s.bed.node("node-a").tmp / "ray").glob("session_2*"))
    gcs = sessions[-1] / "logs" / "gcs_server.out" if sessions else Path("/nonexistent")
    dead = logged_at(gcs, r"node is dead|health check failed", killed_at)
    actor = logged_at(r.run_dir / "logs" / f"{worker.split('.')[0]}.log", "restarted by Ray", killed_at)
    say(
        f"Ray restarted node-b's worker as {new}: node declared dead {_after(dead, killed_at)}, actor "
        f"restarted {_after(actor, killed_at)}, serving {restarted - killed_at:.1f} s after the kill"
    )
    return {
        "worker": worker,
        "restarted_as": new,
        "processes_killed": len(killed),
        "ray_declared_node_dead_after_s": None if dead is None else round(dead - killed_at, 1),
        "actor_restarted_after_s": None if actor is None else round(actor - killed_at, 1),
        "restarted_after_s": round(restarted - killed_at, 1),
        "caught_up_after_s": round(caught - killed_at, 1),
    } | stalls(r.run_dir, killed_at, caught, before=killed_at)


def logged_at(path: Path, pattern: str, after: float) -> float | None:
    """When (unix time) the first line of `path` at or after `after` matching `pattern` was logged: our
    lines start `HH:MM:SS`, Ray's `[YYYY-MM-DD HH:MM:SS,mmm`."""
    if not path.is_file():
        return None
    day = time.strftime("%Y-%m-%d", time.localtime(after))
    for line in path.read_text(errors="replace").splitlines():
        stamp = re.match(r"^\[?(?:(\d{4}-\d\d-\d\d) )?(\d\d:\d\d:\d\d)(?:,(\d{3}))?", line)
        if stamp is None or not re.search(pattern, line, flags=re.I):
            continue
        when = time.mktime(time.strptime(f"{stamp[1] or day} {stamp[2]}", "%Y-%m-%d %H:%M:%S"))
        when += int(stamp[3] or 0) / 1000
        if when >= after - 1.0:  # our stamps are whole seconds
            return when
    return None


def _after(when: float | None, since: float) -> str:
    return "(not found in the logs)" if when is None else f"{when - since:.1f} s"


def _names(r: Run) -> dict[int, str]:
    """pid → role for the actors, which `ps` shows alike (ray::ServiceActor)."""
    names = {}
    for wid in r.watch.last().get("workers", {}):
        pid = wid.rsplit(".", 1)[-1]
        if pid.isdigit():
            names[int(pid)] = f"rollout worker {wid}"
    for pid in pids(r.s.bed.node("node-a")):
        if role_of(pid) == "actor":
            names[pid] = "learner"
    return names


def _audit(s: Smoke, run_dir: Path) -> dict:
    """The run's private Redis started again from its append-only file (on node-a, where it ran), and
    deploy/docker/audit_run.py against it: every published group trained once, queued or accounted for."""
    conf = run_dir / "config" / "redis.conf"
    check = f"SETTINGS={run_dir}/config/learner.yaml python deploy/docker/audit_run.py"
    out = s.own("A", f"redis-server {conf} --daemonize yes >/dev/null\nsleep 1\n{check}", "ray-audit")
    return json.loads(out.strip().splitlines()[-1])


def run_ray(s: Smoke) -> dict:
    model, run_dir = s.root / ".cache" / "tiny-countdown", s.shared / "runs" / "ray"
    (run_dir / "snapshots").mkdir(parents=True, exist_ok=True)  # hidden on B and C: they fetch over HTTP
    hide = [model, run_dir / "snapshots"]
    s.run(PART, "A", "ray start --head", on="A", label="ray-head")
    for letter in ("B", "C"):
        s.run(PART, "B and C", "ray start", on=letter, label=f"ray-node-{letter.lower()}", hide=hide)
    started = time.time()
    up = s.start(PART, "A", "sparkrl up --ray", on="A", label="ray-up")
    r = Run(s, run_dir, up, s.watch(run_dir / "config" / "learner.yaml", "ray-watch"), 0.0)
    r.watch.until(
        f"both workers on a version and step {STEPS_BEFORE}",
        lambda w: len(w.get("workers", {})) == 2 and (w.get("learner") or {}).get("step", 0) >= STEPS_BEFORE,
        480,
        r.alive,
    )
    r.timeout_s = float(s.tuning["SPARKRL_SYNC__TIMEOUT_S"])
    where, wide, others = placement(s.bed.nodes, _names(r))
    say("placement (Ray):\n  " + "\n  ".join(where))
    say("on every interface, not sparkrl's (torch's, Ray's own): " + ("; ".join(others) or "none"))
    if wide:
        raise SmokeFailed("listening on every interface: " + "; ".join(wide))
    cut = partition(r)
    died = machine_dies(r, hide)
    r.wait_steps("steps after the faults", STEPS_AFTER)
    status = s.run(PART, "any", "sparkrl stop", on="C", label="ray-steer")
    if up.wait(180) != 0:
        raise SmokeFailed(f"sparkrl up --ray exited {up.returncode}:\n{tail(s.log('ray-up'))}")
    steps, groups = trained_once(run_dir)
    audit = _audit(s, run_dir)
    logs = "\n".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("worker-*.log"))
    over_http = {
        "model": "model from the learner at http://198.18.0.1:29601" in logs,
        "snapshot": bool(re.search(r"caught up to version \d+ over HTTP \(http://198\.18\.0\.1:29601", logs)),
    }
    for fault in (cut, died):
        # The learner waits for the fleet at most sync.timeout_s (polling adds under a second).
        if fault["longest_fleet_wait_s"] > r.timeout_s + 1.0:
            raise SmokeFailed(
                f"a step waited {fault['longest_fleet_wait_s']} s, past sync.timeout_s: {fault}"
            )
    named = [w for w in ("worker-0.", "worker-1.") if w in status]
    if not audit["ok"] or not all(over_http.values()) or len(named) != 2:
        raise SmokeFailed(f"audit {audit}; fetched over HTTP {over_http}; `sparkrl status` named {named}")
    s.end_nodes()
    return {
        "placement": where,
        "others_on_every_interface": others,
        "steps": steps,
        "groups_trained_once": groups,
        "audit": audit,
        "fetched_over_http": over_http,
        "sync_timeout_s": r.timeout_s,
        "partition": cut,
        "sigkill_node_b": died,
        "seconds": round(time.time() - started, 1),
    }
