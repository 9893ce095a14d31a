"""Part 3 of bench/fleet_scale.py: the control plane and the heartbeats with N simulated workers.

A private Redis and the real control service (`sparkrl control`, its own process, as bench/control_limits.py
starts it). N workers beat every `rollout.heartbeat_s` (a `WorkerStatus` each, through the telemetry
channel, as the rollout heartbeat does), the learner every 2 s; the telemetry logs hold a run's worth of
step rows and broadcasts naming every worker. Then, K times each, timed from this process over HTTP:

- `GET /api/v1/workers`; Prometheus' scrape (`GET /metrics`: the fleet's view);
- the page's refresh, as app.js's `tick` makes it: status, workers and the last 10 broadcasts at once,
  then the step rows since the last one it has, then the evaluations;
- the learner's fleet view, in process: what `learner/fleet.py` reads before a step (the live workers'
  versions, and the oldest each may still publish).

Latency p50/p99 of each, the control service's CPU per request (psutil), and Redis' CPU share of the
heartbeats alone.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import psutil
from control_limits import TOKEN, start_control
from fleet_intake import Redis

from sparkrl.proto import LearnerStatus, WorkerStatus
from sparkrl.proto.telemetry import StepMetrics, SyncEvent
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import BusSettings, RolloutSettings
from sparkrl.services.common.telemetry import LEARNER_HEARTBEAT_S, Telemetry

STEPS = 300  # step rows in the log, like a run a few hundred steps in
METRICS = 80  # values per step row (a real row has about as many: loss/, rollout/, time/, sync/, bus/)


def _worker(worker_id: str, version: int) -> WorkerStatus:
    return WorkerStatus(
        worker_id=worker_id,
        engine="vllm",
        state="generating",
        policy_version=version,
        weights_checksum="ab" * 32,
        tokens_per_s=12_500.0,
        groups_published=1_000,
        prompts_in_flight=8,
        last_sync_seconds=1.5,
        last_sync_bytes=15_000_000_000,
        timings={"generate": 5.0, "score": 0.2, "publish": 0.05},
        temperature=1.0,
        top_p=1.0,
        heartbeat_at=time.time(),
    )


class Heartbeats:
    """N workers and the learner beating on their periods from one thread (each worker at its own phase)."""

    def __init__(self, telemetry: Telemetry, workers: int, period_s: float) -> None:
        self.telemetry, self.workers, self.period_s = telemetry, workers, period_s
        self.stop = threading.Event()
        self.beats = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.time()
        due = [start + self.period_s * i / self.workers for i in range(self.workers)]
        learner_due = start
        while not self.stop.is_set():
            now = time.time()
            for i, at in enumerate(due):
                if at <= now:
                    self.telemetry.put_worker(_worker(f"w{i:03d}", STEPS), ttl_s=3 * self.period_s)
                    due[i] = at + self.period_s
                    self.beats += 1
            if learner_due <= now:
                self.telemetry.put_learner(_learner())
                learner_due += LEARNER_HEARTBEAT_S
            self.stop.wait(max(0.0, min([*due, learner_due]) - time.time()))


def _learner() -> LearnerStatus:
    return LearnerStatus(
        step=STEPS,
        policy_version=STEPS,
        state="training",
        groups_trained=256 * STEPS,
        group_epoch=1,
        last_loss=-0.01,
        hyperparameters={"loss": "lp_reg", "lr": 1e-6},
        heartbeat_at=time.time(),
    )


def _fill_logs(telemetry: Telemetry, workers: int) -> None:
    """A run's telemetry so far: step rows naming every worker's version, broadcasts to all of them."""
    names = [f"w{i:03d}" for i in range(workers)]
    for step in range(1, STEPS + 1):
        metrics = {f"loss/m{j}": 0.001 * j for j in range(METRICS)}
        worker_versions = dict.fromkeys(names, step - 1)
        telemetry.append(
            StepMetrics(
                step=step,
                policy_version=step,
                time=time.time(),
                metrics=metrics,
                worker_versions=worker_versions,
            )
        )
        telemetry.append(
            SyncEvent(
                version=step,
                epoch=1,
                announced_at=time.time(),
                outcome="ok",
                bytes=15_000_000_000,
                buckets=227,
                seconds=2.0,
                members=names,
                acknowledged=names,
            )
        )


def _timed(calls: int, call: Callable[[], Any], pid: int) -> dict[str, float]:
    """`call` `calls` times: latency p50/p99 (ms) and the control service's CPU per call (ms)."""
    process = psutil.Process(pid)
    cpu = sum(process.cpu_times()[:2])
    took = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        took.append(1e3 * (time.perf_counter() - started))
    cpu = sum(process.cpu_times()[:2]) - cpu
    return {
        "p50_ms": round(statistics.median(took), 2),
        "p99_ms": round(float(np.percentile(took, 99)), 2),
        "cpu_ms": round(1e3 * cpu / calls, 2),
    }


async def _tick(client: httpx.AsyncClient) -> None:
    """One refresh of the page (static/app.js `tick`), in steady state: a new step row since the last."""
    got = await asyncio.gather(
        client.get("/api/v1/status"), client.get("/api/v1/workers"), client.get("/api/v1/weights?limit=10")
    )
    for response in got:
        response.raise_for_status()
    (await client.get(f"/api/v1/metrics?since={STEPS - 1}&limit=1000")).raise_for_status()
    (await client.get("/api/v1/evals?limit=500")).raise_for_status()


def measure(server: Redis, workers: int, calls: int, heartbeat_s: float | None = None) -> dict[str, Any]:
    """Each request `calls` times with `workers` workers beating, and Redis' CPU share of the beats."""
    client = server.client()
    client.flushall()
    period = heartbeat_s or RolloutSettings().heartbeat_s
    bus = RedisBus(BusSettings(url=server.url))
    telemetry = Telemetry(bus)
    _fill_logs(telemetry, workers)
    beats = Heartbeats(telemetry, workers, period)
    beats.thread.start()
    proc, url = start_control(server.url)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        redis_proc = psutil.Process(server.proc.pid)
        cpu0, beats0, t0 = sum(redis_proc.cpu_times()[:2]), beats.beats, time.time()
        time.sleep(2 * period)  # heartbeats alone: Redis' share of a core, and the beats per second
        heartbeat_cpu = (sum(redis_proc.cpu_times()[:2]) - cpu0) / (time.time() - t0)
        beats_per_s = (beats.beats - beats0) / (time.time() - t0)
        with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
            http.get("/api/v1/workers").raise_for_status()  # warm: the first call imports and connects
            rows = {
                "workers": _timed(calls, lambda: http.get("/api/v1/workers").raise_for_status(), proc.pid),
                "scrape": _timed(calls, lambda: http.get("/metrics").raise_for_status(), proc.pid),
            }
        loop = asyncio.new_event_loop()  # one browser: one client, its connections kept between ticks
        page = httpx.AsyncClient(base_url=url, headers=headers, timeout=30)
        try:
            rows["page"] = _timed(calls, lambda: loop.run_until_complete(_tick(page)), proc.pid)
        finally:
            loop.run_until_complete(page.aclose())
            loop.close()
        fleet_view = _timed(
            calls, lambda: (telemetry.worker_oldest_versions(), telemetry.live_workers()), proc.pid
        )
        rows["learner_view"] = {k: v for k, v in fleet_view.items() if k != "cpu_ms"}
    finally:
        beats.stop.set()
        beats.thread.join(timeout=10)
        proc.terminate()
        proc.wait(timeout=30)
        bus.close()
    return {
        "workers": workers,
        "heartbeats_per_s": round(beats_per_s, 1),
        "redis_cpu_share_heartbeats": round(heartbeat_cpu, 4),
        "requests": rows,
    }
