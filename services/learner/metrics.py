"""The learner's Prometheus metrics (`sparkrl_learner_*`, `sparkrl_sync_*`), in a registry of its own.

Fed from the same records the telemetry channel carries (a step row, a sync event, a command result),
so Prometheus and the control API never disagree.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sparkrl.proto import CommandResult, StepMetrics, SyncEvent

# A step is sub-second on the demo and minutes on a real model; a broadcast likewise.
_STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_SYNC_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class LearnerMetrics:
    """Counters, gauges and histograms of the training loop and the weight broadcast."""

    registry: CollectorRegistry
    steps: Counter
    step_seconds: Histogram
    groups_trained: Counter
    groups_dropped: Counter
    acked: Counter
    tokens: Counter
    step: Gauge
    policy_version: Gauge
    loss: Gauge
    reward: Gauge
    entropy: Gauge
    reg_tokens: Gauge
    paused: Gauge
    commands: Counter
    checkpoints: Counter
    step_failures: Counter
    nonfinite_skipped: Counter
    nonfinite_in_a_row: Gauge
    checkpoint_failures: Counter
    dead_lettered: Counter
    sync_seconds: Histogram
    sync_bytes: Counter
    sync_failures: Counter
    sync_version: Gauge
    sync_members: Gauge

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._loop_metrics(self.registry)
        self._sync_metrics(self.registry)
        # Every labelled series exists at zero from the first scrape: a rate() over it needs no special case.
        for phase in ("join", "connect", "transfer", "verify"):
            self.sync_failures.labels(phase)
        for command in ("pause", "resume", "stop", "checkpoint", "set_hparams"):
            for outcome in ("applied", "rejected"):
                self.commands.labels(command, outcome)

    def _loop_metrics(self, r: CollectorRegistry) -> None:
        """The training loop's: steps, groups, the last step's numbers, commands, what went wrong."""
        self.steps = Counter("sparkrl_learner_steps", "Optimizer steps taken.", registry=r)
        self.step_seconds = Histogram(
            "sparkrl_learner_step_seconds", "Wall time of one step.", buckets=_STEP_BUCKETS, registry=r
        )
        self.groups_trained = Counter("sparkrl_learner_groups_trained", "Groups trained on.", registry=r)
        self.groups_dropped = Counter(
            "sparkrl_learner_groups_dropped_stale", "Groups dropped as too stale.", registry=r
        )
        self.acked = Counter(
            "sparkrl_learner_trajectories_acked",
            "Trajectory entries acknowledged (trained or dropped).",
            registry=r,
        )
        self.tokens = Counter("sparkrl_learner_tokens_trained", "Completion tokens trained on.", registry=r)
        self.step = Gauge("sparkrl_learner_step", "Steps taken so far.", registry=r)
        self.policy_version = Gauge("sparkrl_learner_policy_version", "Policy version.", registry=r)
        self.loss = Gauge("sparkrl_learner_loss", "Loss of the last step.", registry=r)
        self.reward = Gauge("sparkrl_learner_reward_mean", "Mean reward of the last step.", registry=r)
        self.entropy = Gauge("sparkrl_learner_entropy", "Token entropy of the last step.", registry=r)
        self.reg_tokens = Gauge(
            "sparkrl_learner_reg_tokens", "Tokens Lp-Reg regularized in the last step.", registry=r
        )
        self.paused = Gauge("sparkrl_learner_paused", "1 while paused by the control API.", registry=r)
        self.commands = Counter(
            "sparkrl_learner_commands", "Control commands answered.", ["command", "outcome"], registry=r
        )
        self.checkpoints = Counter("sparkrl_learner_checkpoints", "Checkpoints written.", registry=r)
        self._failure_metrics(r)

    def _failure_metrics(self, r: CollectorRegistry) -> None:
        self.step_failures = Counter(
            "sparkrl_learner_step_failures", "Steps that raised (their groups went back).", registry=r
        )
        self.nonfinite_skipped = Counter(
            "sparkrl_learner_nonfinite_skipped",
            "Optimizer updates not applied: their loss or gradient norm was not finite.",
            registry=r,
        )
        self.nonfinite_in_a_row = Gauge(
            "sparkrl_learner_nonfinite_in_a_row",
            "Steps in a row with an update not applied (learner.max_nonfinite_steps stops the run).",
            registry=r,
        )
        self.checkpoint_failures = Counter(
            "sparkrl_learner_checkpoint_failures",
            "Checkpoints that could not be written (training went on; the journal keeps the steps).",
            registry=r,
        )
        self.dead_lettered = Counter(
            "sparkrl_learner_groups_dead_lettered", "Groups dead-lettered by the learner.", registry=r
        )

    def _sync_metrics(self, r: CollectorRegistry) -> None:
        """The weight broadcast's."""
        self.sync_seconds = Histogram(
            "sparkrl_sync_seconds",
            "Broadcast wall time, announce to every checksum acknowledged.",
            buckets=_SYNC_BUCKETS,
            registry=r,
        )
        self.sync_bytes = Counter("sparkrl_sync_bytes", "Weight bytes broadcast (per member).", registry=r)
        self.sync_failures = Counter(
            "sparkrl_sync_failures", "Broadcasts that failed, by phase.", ["phase"], registry=r
        )
        self.sync_version = Gauge("sparkrl_sync_version", "Newest version every member holds.", registry=r)
        self.sync_members = Gauge("sparkrl_sync_members", "Members of the newest broadcast.", registry=r)

    def observe_step(self, row: StepMetrics, groups: int, acked: int) -> None:
        self.steps.inc()
        self.step.set(row.step)
        self.policy_version.set(row.policy_version)
        self.groups_trained.inc(groups)
        self.groups_dropped.inc(row.value("rollout/dropped_stale") or 0)
        self.acked.inc(acked)
        self.tokens.inc(row.value("rollout/tokens") or 0)
        for gauge, name in (
            (self.loss, "loss/value"),
            (self.reward, "rollout/reward_mean"),
            (self.entropy, "loss/entropy"),
            (self.reg_tokens, "loss/reg_tokens"),
        ):
            value = row.value(name)
            gauge.set(value if value is not None else float("nan"))
        self.step_seconds.observe(row.value("time/step_seconds") or 0.0)

    def observe_sync(self, event: SyncEvent) -> None:
        self.sync_members.set(len(event.members))
        if event.outcome == "ok":
            self.sync_seconds.observe(event.seconds or 0.0)
            self.sync_bytes.inc(event.bytes * len(event.members))
            self.sync_version.set(event.version)
        elif event.outcome == "failed":
            self.sync_failures.labels(event.phase or "unknown").inc()

    def observe_command(self, result: CommandResult) -> None:
        self.commands.labels(result.command, result.outcome).inc()
