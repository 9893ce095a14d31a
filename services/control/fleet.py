"""The fleet's Prometheus view (`sparkrl_fleet_*`), read from the telemetry channel at scrape time, plus
the control service's own command counter. One scrape of the control service shows the whole run."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sparkrl.services.common.bus import BusError, RedisBus
from sparkrl.services.common.telemetry import Telemetry

log = logging.getLogger("sparkrl.control.fleet")


class FleetCollector(Collector):
    """Learner, workers, queues and the newest broadcast, as gauges; nothing cached between scrapes."""

    def __init__(self, telemetry: Telemetry, bus: RedisBus) -> None:
        self.telemetry, self.bus = telemetry, bus

    def collect(self) -> Iterator[Metric]:
        try:
            yield from self._learner()
            yield from self._workers()
            yield from self._queues()
        except BusError as exc:  # Redis down: the scrape still answers, with `sparkrl_fleet_up 0`
            log.warning("fleet scrape without Redis: %s", exc)
            yield GaugeMetricFamily("sparkrl_fleet_up", "1 when the telemetry in Redis is readable.", value=0)
            return
        yield GaugeMetricFamily("sparkrl_fleet_up", "1 when the telemetry in Redis is readable.", value=1)

    def _learner(self) -> Iterator[Metric]:
        learner = self.telemetry.learner()
        alive = Telemetry.learner_alive(learner)
        yield GaugeMetricFamily(
            "sparkrl_fleet_learner_up", "1 while the learner's heartbeat is live.", value=float(alive)
        )
        if learner is not None:
            yield GaugeMetricFamily("sparkrl_fleet_learner_step", "The learner's step.", value=learner.step)
            yield GaugeMetricFamily(
                "sparkrl_fleet_learner_policy_version",
                "The learner's policy version.",
                value=learner.policy_version,
            )
            yield GaugeMetricFamily(
                "sparkrl_fleet_learner_paused",
                "1 while the learner is paused.",
                value=float(learner.state == "paused"),
            )
        last = self.telemetry.last_sync()
        if last is not None:
            yield GaugeMetricFamily(
                "sparkrl_fleet_sync_version", "Newest broadcast's version.", value=last.version
            )
            yield GaugeMetricFamily(
                "sparkrl_fleet_sync_seconds",
                "Newest completed broadcast's wall time.",
                value=last.seconds or 0.0,
            )
            yield GaugeMetricFamily(
                "sparkrl_fleet_sync_dropped", "Workers the newest broadcast dropped.", value=len(last.dropped)
            )

    def _workers(self) -> Iterator[Metric]:
        learner = self.telemetry.learner()
        workers = self.telemetry.workers()
        now = time.time()
        version = GaugeMetricFamily(
            "sparkrl_fleet_worker_policy_version",
            "Version each worker holds (-1: initial).",
            labels=["worker"],
        )
        lag = GaugeMetricFamily("sparkrl_fleet_worker_lag", "Versions behind the learner.", labels=["worker"])
        age = GaugeMetricFamily(
            "sparkrl_fleet_worker_heartbeat_age_seconds",
            "Seconds since the last heartbeat.",
            labels=["worker"],
        )
        speed = GaugeMetricFamily(
            "sparkrl_fleet_worker_tokens_per_second", "Generation speed, last batch.", labels=["worker"]
        )
        failures = CounterMetricFamily(
            "sparkrl_fleet_worker_sync_failures", "Failed syncs.", labels=["worker"]
        )
        for worker_id, s in workers.items():
            held = s.policy_version if s.policy_version is not None else -1
            version.add_metric([worker_id], held)
            if learner is not None and s.policy_version is not None:
                lag.add_metric([worker_id], learner.policy_version - s.policy_version)
            age.add_metric([worker_id], max(0.0, now - s.heartbeat_at))
            speed.add_metric([worker_id], s.tokens_per_s)
            failures.add_metric([worker_id], s.sync_failures)
        yield GaugeMetricFamily("sparkrl_fleet_workers", "Workers with a live heartbeat.", value=len(workers))
        yield from (version, lag, age, speed, failures)

    def _queues(self) -> Iterator[Metric]:
        prompts, trajectories = self.bus.pending_info("prompts"), self.bus.pending_info("trajectories")
        yield GaugeMetricFamily("sparkrl_fleet_prompts_lag", "Prompts not yet taken.", value=prompts.lag)
        yield GaugeMetricFamily(
            "sparkrl_fleet_trajectories_lag", "Groups not yet read by the learner.", value=trajectories.lag
        )
        yield GaugeMetricFamily(
            "sparkrl_fleet_trajectories_pending",
            "Groups read, not yet acknowledged.",
            value=trajectories.pending,
        )
        yield GaugeMetricFamily(
            "sparkrl_fleet_dead_letters",
            "Entries in the dead-letter stream.",
            value=self.bus.dead_letter_count(),
        )


def fleet_registry(telemetry: Telemetry, bus: RedisBus) -> tuple[CollectorRegistry, Counter]:
    """The control service's registry: the fleet view and `sparkrl_control_commands_total`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(telemetry, bus))
    commands = Counter(
        "sparkrl_control_commands",
        "Commands issued, by command and HTTP status.",
        ["command", "code"],
        registry=registry,
    )
    return registry, commands
