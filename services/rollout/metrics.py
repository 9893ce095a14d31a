"""A rollout worker's Prometheus metrics (`sparkrl_rollout_*`), labelled with its worker id, so a fleet's
scrapes aggregate (`sum by (worker)`) without relabelling."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter

from sparkrl.proto import EpisodeTally

if TYPE_CHECKING:
    from sparkrl.services.rollout.agent_loop import EpisodeRun

_GENERATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_SHORT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600)


class WorkerMetrics:
    """One worker's counters and histograms; every metric carries `worker` (the attributes are the
    worker's own series, so they exist at zero from the first scrape)."""

    def __init__(self, worker_id: str) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        label = ["worker"]

        def counter(name: str, doc: str) -> PromCounter:
            return PromCounter(name, doc, label, registry=r).labels(worker_id)

        def counter_by(name: str, doc: str, label: str) -> Callable[[str], PromCounter]:
            """A counter with a second label: this worker's series for each of its values."""
            by = PromCounter(name, doc, ["worker", label], registry=r)
            return lambda value: by.labels(worker_id, value)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=r).labels(worker_id)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=r).labels(worker_id)

        self.generation_seconds = histogram(
            "sparkrl_rollout_generation_seconds", "Wall time generating one batch.", _GENERATION_BUCKETS
        )
        self.score_seconds = histogram(
            "sparkrl_rollout_score_seconds", "Wall time of one scoring call.", _SHORT_BUCKETS
        )
        self.sync_seconds = histogram(
            "sparkrl_rollout_sync_seconds", "Announcement seen → weights loaded.", _SHORT_BUCKETS
        )
        self.tokens = counter("sparkrl_rollout_tokens_generated", "Completion tokens generated.")
        self.groups = counter("sparkrl_rollout_groups_published", "Groups published (new, not replays).")
        self.regenerated = counter(
            "sparkrl_rollout_groups_regenerated",
            "Groups made again: they would have reached the learner stale.",
        )
        self.partial_saved = counter(
            "sparkrl_rollout_partial_groups_saved", "Groups handed over unfinished (the worker stopped)."
        )
        self.partial_continued = counter(
            "sparkrl_rollout_partial_samples_continued", "Samples taken over from saved partial work."
        )
        self.partial_discarded = counter(
            "sparkrl_rollout_partial_samples_discarded",
            "Samples with saved partial work made again from the prompt (too stale, or not fitting).",
        )
        self.sync_failures = counter("sparkrl_rollout_sync_failures", "Weight syncs that failed.")
        self.episodes = counter_by(
            "sparkrl_rollout_episodes", "Episodes played (rollout.agent), by how each ended.", "end"
        )
        self.episode_turns = counter("sparkrl_rollout_episode_turns", "Model turns of the episodes played.")
        self.tool_calls = counter_by(
            "sparkrl_rollout_tool_calls",
            "Tool calls answered, by status (ok, malformed, timeout, ...).",
            "status",
        )
        self.environment_tokens = counter(
            "sparkrl_rollout_environment_tokens", "Tokens the environment wrote into episodes (context only)."
        )
        self.episode_splits = counter(
            "sparkrl_rollout_episode_splits",
            "Episodes split into another training sample: the template could not extend the stream.",
        )
        self.environment_seconds = histogram(
            "sparkrl_rollout_environment_seconds",
            "The environment's answer to one model turn (its tools, or its reply; in process or served).",
            _SHORT_BUCKETS,
        )
        self.policy_version = gauge("sparkrl_rollout_policy_version", "Policy version held (-1: initial).")
        self.in_flight = gauge("sparkrl_rollout_prompts_in_flight", "Prompts taken, not yet published.")
        self.paused = gauge("sparkrl_rollout_paused", "1 while paused by the control API.")
        self.unhealthy = gauge(
            "sparkrl_rollout_unhealthy", "1 while its model or engine fails to generate (takes no prompts)."
        )
        self.feed_held = gauge(
            "sparkrl_rollout_feed_held", "1 while the feed is held by a burst of dead letters (no prompts)."
        )

    def observe_episode(self, run: EpisodeRun) -> None:
        """One episode played: how it ended, its model turns, its tool calls by status, the tokens the
        environment wrote, the splits (samples its template could not extend), how long each of the
        environment's answers took."""
        episode = run.episode
        self.episodes(run.status).inc()
        self.episode_turns.inc(episode.turns)
        for status, count in run.tool_calls.items():
            self.tool_calls(status).inc(count)
        self.environment_tokens.inc(episode.environment_tokens)
        self.episode_splits.inc(episode.splits)
        for seconds in run.environment_seconds:
            self.environment_seconds.observe(seconds)


def tally(before: EpisodeTally | None, runs: list[EpisodeRun]) -> EpisodeTally:
    """`before` (None: nothing yet) with `runs` added: what the worker's heartbeat shows the page."""
    was = before or EpisodeTally()
    ended, calls = Counter(was.episodes), Counter(was.tool_calls)
    for run in runs:
        ended[run.status] += 1
        calls.update(run.tool_calls)
    return EpisodeTally(
        episodes=dict(ended),
        turns=was.turns + sum(run.episode.turns for run in runs),
        tool_calls=dict(calls),
        splits=was.splits + sum(run.episode.splits for run in runs),
        environment_calls=was.environment_calls + sum(len(run.environment_seconds) for run in runs),
        environment_seconds=was.environment_seconds + sum(sum(run.environment_seconds) for run in runs),
    )
