"""Part 1 of bench/fleet_scale.py, the driver's side: one fleet size measured (`measure`) on a variant's
processes (`Side`: fleet_intake.py's intake and publishers), a py-spy profile read back
(`profile_summary`).

A point runs `warmup` + `seconds`; every figure is over the last `seconds` (the window): groups/s and MB/s
published (in) and collated (out), Redis' memory above its empty state and the stream's length, sampled
every 0.25 s, CPU seconds of each process (psutil), Redis' own time per command (`INFO commandstats`,
reset at the window's start), and for the groups published in the window the time to be read off the
stream and to be collated (p50/p99).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import redis
from fleet_intake import MB, Phases, Published, Redis, Run, Taken, scratch

SCRIPT = Path(__file__).with_name("fleet_intake.py")


def _pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 1) if values else float("nan")


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


class Child:
    """A process of fleet_intake.py (`intake` or `publisher`) talking a JSON line each way, kept across
    fleet sizes; with `pythonpath` first on its path, another commit's code (bench/e2e_baseline.py)."""

    proc: subprocess.Popen[str]
    pid: int

    def __init__(self, role: str, pythonpath: Path | None = None) -> None:
        env = dict(os.environ)
        if pythonpath is not None:
            env = {k: v for k, v in env.items() if not k.startswith("SPARKRL_")}
            env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [env.get("PYTHONPATH")])])
        args = [sys.executable, str(SCRIPT), role]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.pid = int(self.answer()["ready"])

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        if not text:
            raise RuntimeError(f"a fleet_intake.py process exited ({self.proc.wait()}) before answering")
        return json.loads(text)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


class Side:
    """One variant's processes: the intake and the simulated workers, both of one commit's code (a group
    one commit frames may carry fields another's decoder refuses)."""

    intake: Child
    publishers: list[Child]
    busy: int  # publishers with workers in the current fleet size

    def __init__(self, publishers: int, pythonpath: Path | None = None) -> None:
        self.intake = Child("intake", pythonpath)
        self.publishers = [Child("publisher", pythonpath) for _ in range(publishers)]
        self.busy = 0

    def prepare(self, run: Run, workers: int, run_dir: Path) -> list[int]:
        """A fresh collector and ledger for `run`, `workers` shared among the publishers (at most one
        worker each); the publishers' pids once all are ready."""
        shares = [list(range(workers))[i :: len(self.publishers)] for i in range(len(self.publishers))]
        self.busy = min(len(self.publishers), workers)
        for i, share in enumerate(shares[: self.busy]):
            self.publishers[i].send(json.dumps({"run": run.to_json(), "workers": share, "seed": 1 + i}))
        self.intake.send(json.dumps({"run": run.to_json(), "run_dir": str(run_dir)}))
        pids = [child.answer()["ready"] for child in self.publishers[: self.busy]]
        self.intake.answer()
        return pids

    def start(self, start_at: float, stop_at: float) -> None:
        for child in self.publishers[: self.busy]:
            child.send(f"{start_at} {stop_at}")
        self.intake.send(str(stop_at))

    def results(self) -> tuple[list[Published], list[Taken], Phases, list[tuple[float, float]]]:
        published = [Published(*row) for c in self.publishers[: self.busy] for row in c.answer()["published"]]
        line = self.intake.answer()
        reads = [(float(a), float(b)) for a, b in line["reads"]]
        return published, [Taken(*row) for row in line["taken"]], Phases(**line["phases"]), reads

    def close(self) -> None:
        for child in [self.intake, *self.publishers]:
            child.close()


def measure(
    server: Redis,
    side: Side,
    run: Run,
    workers: int,
    window: tuple[float, float],
    profile: Path | None = None,
) -> dict[str, Any]:
    """`workers` simulated workers for `warmup` + `seconds` (`window`), the intake draining; figures over
    the last `seconds`. `profile`: py-spy samples the intake over them, idle time included (its wall
    time, not only its CPU), into that file."""
    warmup, seconds = window
    client = server.client()
    client.flushall()
    run_dir = scratch("fleet-intake-")
    try:
        pids = side.prepare(run, workers, run_dir)
        base_memory = int(client.info("memory")["used_memory"])
        start_at = time.time() + 0.2
        w0, w1 = start_at + warmup, start_at + warmup + seconds
        side.start(start_at, w1)
        time.sleep(max(0.0, w0 - time.time()))
        spy = _start_py_spy(side.intake.pid, seconds, profile) if profile else None
        cpu0 = {pid: _cpu_s(pid) for pid in [*pids, side.intake.pid, server.proc.pid]}
        client.config_resetstat()
        memory, stream = _sample_redis(client, run, w1)
        cpu = {pid: _cpu_s(pid) - before for pid, before in cpu0.items()}
        stats = client.info("commandstats")
        published, taken, phases, reads = side.results()
        if spy is not None:
            spy.wait(timeout=60)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    intake_pid = side.intake.pid
    figures = _figures(run, workers, (w0, w1), published, (taken, reads), phases)
    simulator = sum(c for pid, c in cpu.items() if pid in pids)
    cpu_s = {"intake": cpu[intake_pid], "redis": cpu[server.proc.pid], "simulator": simulator}
    # The intake's CPU per group it read; Redis' and the simulator's per group published.
    per = {"intake": figures["groups_read"], "redis": figures["groups_in"], "simulator": figures["groups_in"]}
    usec = {name.removeprefix("cmdstat_"): (int(s["calls"]), float(s["usec"])) for name, s in stats.items()}
    return figures | {
        "redis_memory_mb": _mb(np.mean(memory) - base_memory) if memory else 0.0,
        "redis_memory_mb_max": _mb(max(memory) - base_memory) if memory else 0.0,
        "stream_max": max(stream, default=0),
        "cpu_ms_per_group": {name: round(1e3 * s / max(per[name], 1), 2) for name, s in cpu_s.items()},
        "cpu_share": {name: round(s / seconds, 2) for name, s in cpu_s.items()},
        "redis_ms": {name: round(u / 1e3, 1) for name, (_, u) in usec.items() if "config" not in name},
        "redis_calls": {name: calls for name, (calls, _) in usec.items() if "config" not in name},
    }


def _mb(nbytes: float) -> float:
    return round(nbytes / MB, 1)


def _sample_redis(client: redis.Redis, run: Run, until: float) -> tuple[list[int], list[int]]:
    """Redis' memory and the trajectory stream's length, every 0.25 s until `until`."""
    memory, stream = [], []
    key = f"{run.namespace}:trajectories"
    while time.time() < until:
        memory.append(int(client.info("memory")["used_memory"]))
        stream.append(int(client.xlen(key)))
        time.sleep(min(0.25, max(0.0, until - time.time())))
    return memory, stream


def _start_py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    args = [spy, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--rate", "100"]
    args += ["--format", "raw", "--output", str(out), "--nonblocking", "--idle"]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _figures(
    run: Run,
    workers: int,
    window: tuple[float, float],
    published: list[Published],
    intake: tuple[list[Taken], list[tuple[float, float]]],
    phases: Phases,
) -> dict[str, Any]:
    """Over the window: what was published (in), read off the stream by the collector and collated (out,
    a step at a time: its rate moves in steps' worth), and the ages of what was read and collated."""
    w0, w1 = window
    seconds = w1 - w0
    taken, reads = intake
    sent = [p for p in published if w0 <= p.at < w1]
    read = [(pub, at) for pub, at in reads if w0 <= at < w1]
    out = [t for t in taken if w0 <= t.collated < w1]
    read_age = [1e3 * (at - pub) for pub, at in read]  # behind a backlog, ages grow with it
    collated_age = [1e3 * (t.collated - t.published) for t in out]
    return {
        "workers": workers,
        "step_gps": round(run.prompts_per_step / seconds, 2),  # one step's groups over the window
        "offered_gps": round(workers * run.rate if run.rate else len(sent) / seconds, 2),
        "in_gps": round(len(sent) / seconds, 2),
        "read_gps": round(len(read) / seconds, 2),
        "out_gps": round(len(out) / seconds, 2),
        "in_mbps": _mb(sum(p.nbytes for p in sent) / seconds),
        "out_mbps": _mb(sum(t.nbytes for t in out) / seconds),
        "groups_in": len(sent),
        "groups_read": len(read),
        "groups_out": len(out),
        "read_ms": (_pct(read_age, 50), _pct(read_age, 99)),
        "collated_ms": (_pct(collated_age, 50), _pct(collated_age, 99)),
        "publish_call_ms": _pct([1e3 * p.seconds for p in sent], 50),
        "sim_late_ms": _pct([1e3 * p.late_s for p in sent], 99),
        "phases_s": {"fill": phases.fill, "collate": phases.collate, "commit": phases.commit},
        "steps": phases.steps,
    }


# Frames that name where the intake's wall time goes, outermost first; a sample counts for the first
# (innermost) one on its stack.
PROFILE_CALLS = (
    ("trained", "trained mark lookups (Redis)"),
    ("trained_among", "trained mark lookups (Redis)"),
    ("StreamCommands.xreadgroup", "XREADGROUP (read new entries)"),
    ("Reader.read_new", "XREADGROUP (read new entries)"),  # waiting on the parallel reads (bus/reads.py)
    ("StreamCommands.xautoclaim", "XAUTOCLAIM (reclaim)"),
    ("StreamCommands.xclaim", "XCLAIM (keep held entries alive)"),
    ("decode_group", "decode_group (codec + validation)"),
    ("samples_from_groups", "samples_from_groups"),
    ("update_micro_batches", "collate (update_micro_batches)"),
    ("Journal.write", "journal write + fsync"),
    ("Ledger.commit", "trained marks + ack"),
    ("BatchCollector.fill", "fill, elsewhere"),
)


def profile_summary(path: Path, top: int = 8) -> dict[str, Any]:
    """A py-spy raw profile read back: the share of samples under each of PROFILE_CALLS (the innermost
    named frame wins), and the hottest leaf functions."""
    calls: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "intake_main" not in stack:
            continue  # the pipe's feeder thread and interpreter start-up
        frames = [frame.split(" (")[0] for frame in stack.split(";")]
        n = int(count)
        total += n
        named = [label for frame in reversed(frames) for name, label in PROFILE_CALLS if frame == name]
        calls[named[0] if named else "intake loop, elsewhere"] += n
        leaves[frames[-1]] += n
    share = {name: round(c / max(total, 1), 3) for name, c in calls.most_common()}
    hottest = {name: round(c / max(total, 1), 3) for name, c in leaves.most_common(top)}
    return {"samples": total, "calls": share, "leaves": hottest}
