"""The rollout worker: one process, one loop — control → sync weights → pull prompts → generate → score →
publish → ack.

A prompt is acknowledged only after its group is published (idempotently, by group id), so a worker that
dies at any point loses nothing: its pending prompts are reclaimed by another worker after
`bus.claim_idle_ms`, and a replayed group id is dropped by the bus. SIGTERM/SIGINT or a stop command stop
generation at the next decoding step and hand the batch in hand over (`partials.py`: saved, its prompts
released, continued by the next worker; with `rollout.partial.enabled` false, the batch is finished
first); SIGKILL leaves the batch to be reclaimed and made again. With `rollout.weight_updates: in_flight`
a newer version is taken between two decoding steps, not only between batches. Paused, it takes no new
prompts but keeps syncing weights and reporting. A generation that fails for a reason of the model or the
engine makes it unhealthy (`health.py`): its prompts go back to the fleet; only a prompt shown to be the
cause is dead-lettered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from sparkrl.proto import (
    Completion,
    LearnerStatus,
    TrajectoryGroup,
    WeightAnnouncement,
)
from sparkrl.proto.codec import Wire
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.metrics_server import MetricsServer
from sparkrl.services.common.prompt_limits import PromptLimits
from sparkrl.services.common.reward_client import RewardClient, RewardServiceError
from sparkrl.services.common.settings import RolloutSettings
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.common.weight_sync import (
    EpochOver,
    NotAMember,
    Received,
    SyncFailed,
    WeightReceiver,
)
from sparkrl.services.rollout.announcements import AnnouncementGate
from sparkrl.services.rollout.batch import PromptBatch, pull_prompts, score_groups
from sparkrl.services.rollout.catch_up import catch_up
from sparkrl.services.rollout.control import WorkerControl
from sparkrl.services.rollout.engine import Engine, Interrupts, WeightLoadFailed
from sparkrl.services.rollout.health import HealthGuard, diagnose
from sparkrl.services.rollout.heartbeat import Heartbeat, WorkerState
from sparkrl.services.rollout.install import VersionInstaller
from sparkrl.services.rollout.lockstep import Lockstep
from sparkrl.services.rollout.metrics import WorkerMetrics
from sparkrl.services.rollout.partials import Handover, Taken, fill_gaps
from sparkrl.services.rollout.play_batch import EpisodePlayer, Made
from sparkrl.services.rollout.publish import publish_groups, too_stale

log = logging.getLogger("sparkrl.rollout")


LEARNER_STATUS_REUSE_S = 0.05  # a batch's groups share one read of the learner's status
PAUSED_POLL_S = 0.2  # how often a paused worker looks at the control stream and the announcement
CONTROL_POLL_S = 0.5  # how often a generating worker looks at the control stream (rollout.partial: a stop)
_REGENERATE_ROUNDS = 3  # a group is made again at most twice; the last round publishes whatever it is


def sync_weights(
    gate: AnnouncementGate,
    receiver: WeightReceiver,
    installer: VersionInstaller,
    state: WorkerState,
    metrics: WorkerMetrics,
    secret: str | None,
) -> bool:
    """Between generation steps: take the announced version if we are in its group, else catch up from the
    snapshot; True when the weights were loaded. A failed sync only costs this version: the learner re-forms
    the group for the next one."""
    announcement, engine = gate.latest(), installer.engine
    if announcement is None:
        return False
    # `!=`, not `>`: a learner resumed from an older checkpoint is followed back too.
    fresh = announcement.version != engine.policy_version
    # A member joins its epoch even when it holds the version already (it caught up from the snapshot
    # file, which can be newer than the announcement it read): the learner waits for every member. An
    # epoch it failed in is dead (the learner forms a new one): meanwhile it catches up from the snapshot.
    epoch = announcement.group_epoch
    awaited = (
        state.worker_id in announcement.members
        and epoch != receiver.failed_epoch
        and (fresh or epoch != receiver.held_epoch)
    )
    if not fresh and not awaited:
        return False
    start, previous = time.monotonic(), state.state
    state.state = "syncing"
    try:
        nbytes = (
            _take(receiver, installer, announcement, gate, secret)
            if awaited
            else catch_up(installer, announcement, gate, secret)
        )
    except NotAMember:
        return False
    except (SyncFailed, OSError, WeightLoadFailed) as exc:
        _count_failure(announcement.version, exc, state, metrics)
        return False
    finally:
        state.state = previous
    if nbytes is None:
        return False
    state.policy_version = engine.policy_version
    state.weights_checksum = installer.checksum()  # of what the engine holds (an adapter: the adapter's)
    state.last_sync_seconds, state.last_sync_bytes = time.monotonic() - start, nbytes
    metrics.sync_seconds.observe(state.last_sync_seconds)
    metrics.policy_version.set(engine.policy_version if engine.policy_version is not None else -1)
    log.info("now on policy version %d (%.2fs)", engine.policy_version, state.last_sync_seconds)
    return True


def _take(
    receiver: WeightReceiver,
    installer: VersionInstaller,
    announcement: WeightAnnouncement,
    gate: AnnouncementGate,
    secret: str | None,
) -> int | None:
    """As a member of the announced epoch: the version, loaded unless the engine took it in place; its
    bytes. When that epoch is over already (a late or replayed announcement: it fails at once), the
    snapshot instead, as a late joiner loads it; the learner's next epoch takes this worker in again."""
    try:
        delivery = receiver.receive(announcement)
    except EpochOver as exc:
        log.warning("%s; catching up from the snapshot instead", exc)
        return catch_up(installer, announcement, gate, secret)
    if isinstance(delivery, Received):
        installer.install(delivery.tensors, announcement.version, announcement.adapter_base)
    return announcement.total_bytes


def _count_failure(version: int, exc: Exception, state: WorkerState, metrics: WorkerMetrics) -> None:
    """A failed sync is retried between batches; a learner that is gone (its run ended) is retried quietly."""
    if state.failed_version == version:
        log.debug("weight sync of version %d failed again: %s", version, exc)
        return
    log.warning("weight sync of version %d failed: %s", version, exc)
    state.failed_version = version
    state.sync_failures += 1
    metrics.sync_failures.inc()


@dataclass
class Worker:
    """The loop's parts, built once by `main`."""

    bus: RedisBus
    engine: Engine
    reward: RewardClient
    cfg: RolloutSettings  # its sampling: the control's values in force, put in place between batches (step)
    limits: PromptLimits  # how long a prompt may be (rollout.max_prompt_tokens, resolved against the model)
    state: WorkerState
    control: WorkerControl
    metrics: WorkerMetrics
    stop: threading.Event
    gate: AnnouncementGate
    receiver: WeightReceiver
    installer: VersionInstaller  # loads what the receiver or a snapshot delivers (an adapter: merged)
    heartbeat: Heartbeat
    telemetry: Telemetry
    secret: str | None  # sync.secret: authenticates announcements and the learner's weight files
    server: MetricsServer  # /metrics and /healthz
    lockstep: Lockstep  # rollout.lockstep_groups: wait for each new version after this worker's share
    health: HealthGuard  # unhealthy (a sick model) and the feed hold (a burst of dead letters)
    handover: Handover  # rollout.partial: saved work taken, unfinished work handed over
    player: EpisodePlayer  # rollout.agent: the batch as multi-turn episodes (and their handover)
    parts: dict[str, float] = field(default_factory=dict)  # seconds per part of the batch in hand

    def sync(self) -> None:
        """Follow the learner's newest version, if it is one we may follow."""
        started = time.perf_counter()
        changed = sync_weights(
            self.gate, self.receiver, self.installer, self.state, self.metrics, self.secret
        )
        self.parts["sync"] = self.parts.get("sync", 0.0) + time.perf_counter() - started
        if changed:
            self.heartbeat.beat()  # the learner and the monitor see the new version now, not a period later

    def run_step(self) -> bool:
        """One batch: pull, generate, score, publish; False when there was nothing to do. A group that
        would reach the learner too stale (the weights moved on while it was made or waited to go out) is
        made again with the newest weights: a slow spell costs time, not data."""
        cfg = self.cfg
        batch = pull_prompts(
            self.bus,
            self.engine,
            self.state.worker_id,
            cfg.prompts_per_batch,
            self.limits,
            fmt=cfg.prompt_format,
        )
        if batch is None:
            self.health.check_burst()  # a pull may have dead-lettered every prompt it took
            return False
        self.state.in_flight = [e.entry_id for e in batch.entries]
        self.metrics.in_flight.set(len(self.state.in_flight))
        taken = self.handover.take(batch, cfg.sampling)
        for attempt in range(_REGENERATE_ROUNDS):
            again = self._generate_score_publish(batch, attempt == _REGENERATE_ROUNDS - 1, taken)
            if again is None:
                break
            self.metrics.regenerated.inc(len(again.prompts))
            self.sync()  # the newest weights first
            batch, taken = again, taken.spent()  # made again from their prompts
        self.health.check_burst()
        return self._done()

    def _generate_score_publish(self, batch: PromptBatch, last: bool, taken: Taken) -> PromptBatch | None:
        """The prompts whose groups to make again; None when done (published, dead-lettered, handed over,
        given up)."""
        state, metrics = self.state, self.metrics
        state.state = "generating"
        state.in_hand_version = taken.oldest(state.policy_version)
        episodes = None
        with metrics.generation_seconds.time(), self._part("generate"):
            start = time.monotonic()
            if self.cfg.agent.environment is None:
                made = self._generate(batch, taken)
            else:
                made, episodes = self.player.play(batch, self.cfg, self.sync)
        if made is None:
            state.in_hand_version = None
            return None
        batch, completions = made
        tokens = sum(c.num_tokens for group in completions for c in group)
        state.tokens_per_s = tokens / max(time.monotonic() - start, 1e-9)
        metrics.tokens.inc(tokens)
        if any(c.finish_reason == "abort" for group in completions for c in group):
            self._hand_over(batch, completions)  # stopped: the next worker goes on with them
            state.in_hand_version = None
            return None
        try:
            with metrics.score_seconds.time(), self._part("score"):
                groups = score_groups(
                    self.reward, self.engine, batch, completions, self.cfg, self.state.worker_id, episodes
                )
            state.judge = self.reward.judged
        except RewardServiceError as exc:
            # Not acked: the prompts come back (to us or another worker) after bus.claim_idle_ms.
            log.error("scoring failed, leaving %d prompts to be reclaimed: %s", len(batch.prompts), exc)
            state.in_hand_version = None
            return None
        groups = [taken.annotate(group) for group in groups]
        doomed = (lambda group: False) if last else self.doomed_check()
        try:
            with self._part("publish"):  # waiting on a full stream (the learner's pace) included
                wire = Wire(self.cfg.wire.logprobs, self.cfg.wire.topk_logprobs)
                out = publish_groups(self.bus, groups, batch.entries, self.stop, self.waiting, doomed, wire)
        finally:
            if state.state == "stream_full":
                state.state = "generating"
            made_with = state.in_hand_version
            moved_on, state.in_hand_version = made_with != state.policy_version, None
            if moved_on:  # it followed newer weights while these waited: the learner may be waiting on them
                self.heartbeat.beat()
        self.handover.published([groups[i].group_id for i in out.done], taken)
        self.player.published([groups[i].group_id for i in out.done])
        left = [i for i in range(len(groups)) if i not in out.done and i not in out.redo]
        if left:  # the stream stayed full until a stop or the deadline: made, scored, handed over
            self._hand_over(batch.subset(left), [completions[i] for i in left])
        state.groups_published += out.new
        metrics.groups.inc(out.new)
        self.lockstep.record(made_with, out.new)
        return batch.subset(out.redo) if out.redo else None

    def _hand_over(self, batch: PromptBatch, completions: list[list[Completion]]) -> None:
        handed = {e.entry_id for e in batch.entries}
        with self.heartbeat.touching:  # no beat may touch (keep) what is released now
            self.state.in_flight = [e for e in self.state.in_flight if e not in handed]
        self.handover.save(batch, completions, self.cfg.sampling)

    def _generate(self, batch: PromptBatch, taken: Taken) -> Made | None:
        """The batch's completions (continuing the samples `taken` holds); after a failure, those of the
        prompts that generate alone (the ones that fail alone while the engine works are dead-lettered), or
        None when the model or engine is at fault (the worker falls sick, the prompts stay unacknowledged,
        to be reclaimed)."""
        sampling = batch.sampling(self.cfg.sampling)
        prefixes = taken.prefixes_for(batch)
        try:
            return batch, self.engine.generate(
                batch.token_ids,
                sampling,
                prefixes=None if prefixes is None else fill_gaps(prefixes, sampling.n),
                interrupts=self.interrupts(len(batch.prompts)),
            )
        except Exception as exc:  # a prompt the engine refuses, or a sick model: `diagnose` tells which
            log.warning("generation of %d prompts failed (%s: %s); diagnosing", len(batch.prompts),
                        type(exc).__name__, exc)  # fmt: skip
            found = diagnose(self.engine, batch.token_ids, sampling, exc, self.cfg.prompt_format)
        if found.sick is not None:
            self.health.fall_sick(found.sick)
            return None
        for index, why in found.bad.items():
            self.bus.dead_letter("prompts", batch.entries[index], f"generation failed: {why}")
        keep = sorted(found.completions)
        if not keep:
            return None
        return batch.subset(keep), [found.completions[i] for i in keep]

    def interrupts(self, in_hand: int) -> Interrupts | None:
        """What the engine does between two decoding steps: with `rollout.partial`, stop for a stop (a
        signal, or a stop command: the control stream is read every CONTROL_POLL_S; the batch, `in_hand`
        groups, is handed over) or when this worker dropped out of a weight broadcast (the fleet's newer
        weights go on with its samples); with `weight_updates: in_flight`, take a newer version (looked
        for every `in_flight.poll_s`) through the same announce → receive → verify → acknowledge path as
        between batches. None when neither is on."""
        cfg = self.cfg
        follow, hand_over = cfg.weight_updates == "in_flight", cfg.partial.enabled
        if not follow and not hand_over:
            return None
        now = time.monotonic()
        next_look, next_control = [now + cfg.in_flight.poll_s], [now + CONTROL_POLL_S]

        def poll() -> bool:
            if hand_over and time.monotonic() >= next_control[0]:
                self.control.boundary(in_hand)  # a stop sets self.stop; pause and sampling: the next batch
                next_control[0] = time.monotonic() + CONTROL_POLL_S
            if hand_over and self.stop.is_set():
                return True
            if follow and time.monotonic() >= next_look[0]:
                failures = self.state.sync_failures
                self.sync()
                next_look[0] = time.monotonic() + cfg.in_flight.poll_s
                if hand_over and self.state.sync_failures > failures:
                    log.warning("dropped out of a weight broadcast mid-generation: handing the batch over")
                    return True
            return False

        return Interrupts(poll, cfg.in_flight.kv_cache)

    def doomed_check(self) -> Callable[[TrajectoryGroup], bool]:
        """Whether a group is already older than the learner's `max_staleness` (in force, as its status
        reports it: a live change applies here too) against the version the learner holds now."""

        seen: list[tuple[float, LearnerStatus | None]] = []  # (when read, the status): read once a turn

        def doomed(group: TrajectoryGroup) -> bool:
            if not seen or time.monotonic() - seen[-1][0] > LEARNER_STATUS_REUSE_S:
                seen[:] = [(time.monotonic(), self.telemetry.learner())]
            return too_stale(seen[-1][1], group.oldest_policy_version)

        return doomed

    def waiting(self, in_hand: int) -> None:
        """Between tries to publish into a full stream: alive, answering control commands, and following
        the weights (a learner waiting for this worker to catch up must not wait on its own full stream).
        Its status says so: made groups wait on the learner's pace, not on generation."""
        self.state.state = "stream_full"
        self.state.progress_at = time.time()
        self.control.boundary(in_hand)
        self.sync()

    @contextmanager
    def _part(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - started

    def _done(self) -> bool:
        self.state.in_flight = []
        self.metrics.in_flight.set(0)
        self.state.timings, self.parts = self.parts, {}  # the batch's breakdown, reported by the heartbeat
        return True
