"""What a rollout worker reports: its state (written by the loop) and the heartbeat thread that sends it.

A thread, because the loop blocks inside generate(); every period it reports `WorkerStatus` (through the
telemetry channel) and keeps the prompts in hand from being reclaimed mid-generation. `progress_at` is
the loop's own sign of life, so a live heartbeat over a hung loop is still seen as hung.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sparkrl.proto import EpisodeTally, WorkerStatus
from sparkrl.proto.reward import JudgeUsage
from sparkrl.services.common.bus import BusStopping
from sparkrl.services.common.settings import SamplingSettings
from sparkrl.services.common.telemetry import Telemetry

log = logging.getLogger("sparkrl.rollout")


@dataclass
class WorkerState:
    """What the heartbeat reports; written by the loop, read by the heartbeat thread."""

    worker_id: str
    engine: str
    state: str = "starting"
    state_reason: str | None = None  # why `unhealthy` or `held`
    policy_version: int | None = None
    in_hand_version: int | None = None  # the version the groups being made or published were made with
    timings: dict[str, float] = field(default_factory=dict)  # seconds per part of the last batch
    started_at: float = field(default_factory=time.time)  # this process's incarnation
    startup_s: dict[str, float] = field(default_factory=dict)  # start_clock.py
    weights_checksum: str | None = None
    tokens_per_s: float = 0.0
    groups_published: int = 0
    in_flight: list[str] = field(default_factory=list)  # prompt-stream entry ids being worked on
    last_sync_seconds: float | None = None
    last_sync_bytes: int | None = None
    sync_failures: int = 0
    failed_version: int | None = None  # the version whose sync failed last: counted and logged once
    progress_at: float = field(
        default_factory=time.time
    )  # the loop's last sign of life (not the heartbeat's)
    episodes: EpisodeTally | None = None  # rollout.agent: its episodes so far (the worker adds to it)
    judge: JudgeUsage | None = None  # what the LLM judge spent on its groups so far (reward service's word)


class Heartbeat(threading.Thread):
    """Reports `WorkerState` every period and keeps in-flight prompts from being reclaimed mid-generation
    (generation can outlast `bus.claim_idle_ms`); a thread because the loop blocks inside generate()."""

    def __init__(
        self,
        telemetry: Telemetry,
        state: WorkerState,
        sampling: Callable[[], SamplingSettings],
        period_s: float,
    ) -> None:
        """`sampling`: the sampling values in force (the worker's control replaces them on a change)."""
        super().__init__(name="heartbeat", daemon=True)
        self.telemetry, self.bus, self.state, self.period_s = telemetry, telemetry.bus, state, period_s
        self.sampling = sampling
        self.stopped = threading.Event()
        # Held while the in-flight prompts are read and touched: a worker that releases prompts (partial
        # work handed over) takes them out of `in_flight` under it, so no beat touches them afterwards.
        self.touching = threading.Lock()

    def run(self) -> None:
        while not self.stopped.wait(self.period_s):
            self.beat()

    def beat(self) -> None:
        s, sampling = self.state, self.sampling()
        try:
            with self.touching:
                self.bus.touch("prompts", s.worker_id, list(s.in_flight))
            lag = self.bus.pending_info("prompts").lag
            status = WorkerStatus(
                worker_id=s.worker_id,
                engine=s.engine,
                state=s.state,
                state_reason=s.state_reason[:2000] if s.state_reason is not None else None,
                policy_version=s.policy_version,
                weights_checksum=s.weights_checksum,
                tokens_per_s=s.tokens_per_s,
                groups_published=s.groups_published,
                prompts_in_flight=len(s.in_flight),
                queue_lag=lag,
                last_sync_seconds=s.last_sync_seconds,
                last_sync_bytes=s.last_sync_bytes,
                sync_failures=s.sync_failures,
                in_hand_version=s.in_hand_version,
                timings=dict(s.timings),
                started_at=s.started_at,
                startup_s=dict(s.startup_s),
                progress_at=s.progress_at,
                episodes=s.episodes,
                judge=s.judge,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                heartbeat_at=time.time(),
            )
            self.telemetry.put_worker(status, ttl_s=3 * self.period_s)
        except BusStopping as exc:  # the worker is stopping and Redis is down: its status expires alone
            log.warning("last heartbeat not sent, stopping without Redis: %s", exc)
        except Exception:  # a missed beat must never kill the worker; the next one retries
            log.exception("heartbeat failed")
