"""The reward service's Prometheus metrics, in a registry of its own (two apps in one process stay apart)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sparkrl.proto.reward import REWARD_STATUSES, JudgeUsage, RewardItem, RewardResult
from sparkrl.services.reward.pool import PoolStats

# Verification is milliseconds when healthy; the tail up to the item time limit is what matters.
_ITEM_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600)
_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _PoolCollector(Collector):
    """Reads the pool's own counters at scrape time, so the pool needs no Prometheus code."""

    def __init__(self, stats: Callable[[], PoolStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield CounterMetricFamily(
            "sparkrl_reward_pool_restarts", "Verifier processes killed and replaced.", value=stats.restarts
        )
        yield CounterMetricFamily(
            "sparkrl_reward_pool_crashes", "Verifier processes that died on their own.", value=stats.crashes
        )
        yield GaugeMetricFamily("sparkrl_reward_pool_processes", "Pool size.", value=stats.processes)
        yield GaugeMetricFamily("sparkrl_reward_pool_alive", "Verifier processes alive.", value=stats.alive)
        yield GaugeMetricFamily("sparkrl_reward_pool_busy", "Items being verified now.", value=stats.busy)
        yield GaugeMetricFamily(
            "sparkrl_reward_pool_queued", "Items waiting for a process.", value=stats.queued
        )


class _JudgeCollector(Collector):
    """What the judge has spent, at scrape time (judge.py): calls made (retries included), items found in its
    cache, tokens its endpoint reported, its items by status (a mix's judge part included) and their
    seconds."""

    def __init__(self, spent: Callable[[], JudgeUsage]) -> None:
        self._spent = spent

    def collect(self) -> Iterator[Metric]:
        spent = self._spent()
        for metric, value, doc in [
            ("sparkrl_reward_judge_calls", spent.calls, "Calls to the judge's endpoint, retries included."),
            ("sparkrl_reward_judge_cache_hits", spent.cache_hits, "Judge items answered from its cache."),
            ("sparkrl_reward_judge_tokens", spent.tokens, "Tokens the judge's endpoint reported (usage)."),
            ("sparkrl_reward_judge_seconds", spent.seconds, "Wall time of the judge's items, summed."),
        ]:
            yield CounterMetricFamily(metric, doc, value=value)
        items = CounterMetricFamily(
            "sparkrl_reward_judge_items", "Items the judge scored, by status.", labels=["status"]
        )
        for status in REWARD_STATUSES:  # every series from the first scrape, at zero until it happens
            if status != "no_answer":
                items.add_metric([status], spent.items.get(status, 0))  # type: ignore[call-overload]
        yield items


class RewardMetrics:
    """Counters and histograms of `/score`, plus the pool's state."""

    def __init__(
        self, pool_stats: Callable[[], PoolStats], judge_spent: Callable[[], JudgeUsage] | None = None
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.items = Counter(
            "sparkrl_reward_items",
            "Items scored, by task and status.",
            ["task", "status"],
            registry=self.registry,
        )
        self.timeouts = Counter(
            "sparkrl_reward_timeouts",
            "Items that ran past their time limit.",
            ["task"],
            registry=self.registry,
        )
        self.item_seconds = Histogram(
            "sparkrl_reward_item_seconds",
            "Wall time verifying one item (excluding queueing).",
            ["task"],
            buckets=_ITEM_BUCKETS,
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "sparkrl_reward_request_seconds",
            "Wall time of one POST /score, from parsed body to response.",
            buckets=_REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.cancelled = Counter(
            "sparkrl_reward_requests_cancelled",
            "Requests whose client went away before the answer (their work was stopped).",
            registry=self.registry,
        )
        self.registry.register(_PoolCollector(pool_stats))
        if judge_spent is not None:
            self.registry.register(_JudgeCollector(judge_spent))

    def observe(self, items: list[RewardItem], results: list[RewardResult], request_s: float) -> None:
        for item, result in zip(items, results, strict=True):
            self.items.labels(item.task, result.status).inc()
            self.item_seconds.labels(item.task).observe(result.elapsed_s)
            if result.status == "timeout":
                self.timeouts.labels(item.task).inc()
        self.request_seconds.observe(request_s)
