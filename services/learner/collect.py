"""Batch assembly from the trajectory stream: `prompts_per_step` fresh, untrained groups per step (with
`learner.batch: grow`, more when held groups would go stale before the next step; see `fill`).

A collector keeps what it has gathered when it is interrupted (a pause, a control command, a stop) and
goes on from there, so an interruption never drops or re-reads a group. While it holds entries it keeps
them from being reclaimed (`touch`), including while the learner is paused. A group the learner's model
cannot take (`validate.py`) is dead-lettered alone, with the reason, before it joins a batch; the groups
of a failed step come back through `give_back`. A group that went stale in the stream or in hand is sent
back: acknowledged and its prompt fed again (`RedisBus.send_back`), so finite data is made again with
newer weights instead of lost; the run ends only once every prompt fed is trained or dead-lettered.
With `learner.filter_groups`, a group whose rewards are all equal is set aside as soon as it is read
(recorded, marked and acknowledged by the ledger's `FilteredLog`): it never counts toward a batch
(dynamic_sampling.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sparkrl.proto import TrajectoryGroup, decode_group, encode_message
from sparkrl.proto.run_files import PromptCounts
from sparkrl.proto.staleness import too_stale
from sparkrl.services.common.bus import Entry, RedisBus
from sparkrl.services.common.feeder import feed_held
from sparkrl.services.common.settings import LearnerSettings
from sparkrl.services.learner.data_end import Fed, Progress, Tally, count_prompts, end_reason, feed_done
from sparkrl.services.learner.dynamic_sampling import filtered
from sparkrl.services.learner.ledger import Batch, FilteredLog, trained_among
from sparkrl.services.learner.prefetch import Prefetch
from sparkrl.services.learner.validate import ModelLimits, group_problem

CONSUMER = "learner"
STARVED_LOG_S = 30.0  # how often a learner waiting for groups says so
EXHAUSTED_CHECK_S = 1.0  # how often a learner waiting for groups looks whether the data ran out

log = logging.getLogger("sparkrl.learner")


@dataclass
class BatchCollector:
    """Gathers one step's groups across as many `fill` calls as it takes."""

    bus: RedisBus
    cfg: LearnerSettings  # as configured; the live `max_staleness` comes with each read
    limits: ModelLimits
    groups: list[TrajectoryGroup] = field(default_factory=list)  # held for a coming batch, in arrival order
    entries: list[Entry] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    dropped: int = 0  # stale groups sent back while gathering this batch
    filtered: int = 0  # uninformative groups set aside while gathering this batch (learner.filter_groups)
    filtered_log: FilteredLog | None = None  # where they are recorded; needed with learner.filter_groups
    acked: int = 0  # entries acknowledged here (sent back or already trained) since `take_acked`
    dead_lettered: int = 0  # groups the model cannot take, since start
    void_versions: list[list[int]] = field(default_factory=list)  # see TrainState.void_versions
    progress: Progress = field(default_factory=Tally)  # the learner's TrainState: what it has trained
    ran_out: Fed | None = None  # the feed is done and all of it is read: no more data will come
    counts: PromptCounts | None = None  # how the prompts fed ended, as the last end reason said
    prefetch: Prefetch | None = None  # learner.read_ahead_mb: the stream read on a thread (prefetch.py)
    handed: list[Entry] = field(default_factory=list)  # the last batch's entries: trained, kept alive
    # Each held group's oldest policy version, worked out once: the stale check looks at every held group
    # on every read, and a group's 16 version arrays read each time took a third of a wide run's learner.
    oldest: dict[str, int | None] = field(default_factory=dict)

    @property
    def exhausted(self) -> str | None:
        """The end reason once no more data will come (None before), with how the prompts fed ended:
        counted when read, so the last step's groups are in it (and kept in `counts`, for ended.json)."""
        if self.ran_out is None:
            return None
        filtered = len(self.filtered_log.ids) if self.filtered_log is not None else 0  # its file's count
        self.counts = count_prompts(self.bus, self.ran_out, self.progress, filtered)
        return end_reason(self.counts)

    def fill(self, version: int, max_staleness: int, interrupted: Callable[[], bool]) -> Batch | None:
        """Read until the batch is full (then hand it over and start the next), or None as soon as
        `interrupted()` says so, keeping what was gathered. `max_staleness`: the one in force.

        Whatever is waiting is read ahead and the oldest groups go first: the ones nearest to going stale
        are trained while they still can be (with `batch: grow`, those that could not wait for the next
        step join this one),
        so a burst of groups (after a stalled broadcast, at start-up) is worked through instead of dropped.
        Held groups are kept alive, never reclaimed from us.
        """
        need = self.cfg.prompts_per_step
        self.read_ahead(version, max_staleness)
        since = said = checked = time.monotonic()
        while len(self.groups) < need:
            if interrupted():
                return None
            self._read(version, need - len(self.groups), None, max_staleness)
            if time.monotonic() - checked > EXHAUSTED_CHECK_S:
                checked = time.monotonic()
                self.ran_out = self._data_exhausted()
                if self.ran_out is not None:  # the last, partial step: what is held (nothing: no step)
                    need = len(self.groups)
                    if not need:
                        return None
                    break
            if time.monotonic() - said > STARVED_LOG_S:
                said = time.monotonic()
                self._say_starved(need, said - since)
            # The rest of a worker's burst (its groups are published one by one) joins now, not after
            # this step, when the oldest of it may be past reach.
            self.read_ahead(version, max_staleness)
        order = sorted(range(len(self.groups)), key=lambda i: (self._oldest(self.groups[i], version), i))
        # learner.batch grow: a held group that would be too stale for the next step joins this one (the
        # step grows to at most what read-ahead holds): a burst is trained, not made again. fixed: it
        # stays held, and the next read sends it back (its prompt fed again): every step is `need` groups.
        doomed = [
            i
            for i in order[need:]
            if too_stale(self._oldest(self.groups[i], version), version + 1, max_staleness)
        ]
        grown = min(len(doomed), self.reach(max_staleness) - need) if self.cfg.batch == "grow" else 0
        cut = need + grown
        chosen, kept = order[:cut], sorted(order[cut:])
        lags = [version - self._oldest(self.groups[i], version) for i in chosen]
        batch = Batch(
            [self.groups[i] for i in chosen],
            [self.entries[i] for i in chosen],
            self.dropped,
            sum(lags) / len(lags),
            self.filtered,
        )
        self.groups, self.entries = [self.groups[i] for i in kept], [self.entries[i] for i in kept]
        self.handed = batch.entries
        self.seen, self.dropped, self.filtered = {g.group_id for g in self.groups}, 0, 0
        self.oldest = {gid: self.oldest[gid] for gid in self.seen if gid in self.oldest}
        return batch

    def _data_exhausted(self) -> Fed | None:
        """What was fed, once nothing more will come (else None): the feeder fed all it had, no prompt is
        unread or in a worker's hands (a worker acknowledges its prompt once the group is published, and a
        stale group's prompt goes back in the same step as the group goes), and no group is left in the
        trajectory stream but the ones held here."""
        fed = feed_done(self.bus)
        if fed is None:  # no feed yet, or one under way
            return None
        prompts, trajectories = self.bus.pending_info("prompts"), self.bus.pending_info("trajectories")
        if prompts.lag or prompts.pending or trajectories.lag or trajectories.pending > len(self.entries):
            return None
        return fed

    def _say_starved(self, need: int, waited_s: float) -> None:
        """A learner waiting long for groups says so, and what the prompt stream holds: an empty one with
        nothing pending means the prompts ran out (or no worker is running); a held feed says why."""
        prompts, hold = self.bus.pending_info("prompts"), feed_held(self.bus)
        if hold is not None:
            why = f" — the feed is held ({hold.detail})"
        elif prompts.lag == 0 and prompts.pending == 0:
            why = " — the prompts ran out: raise prompts.count, or feed more (sparkrl prompts)"
        else:
            why = ""
        log.warning(
            "waiting %.0fs for trajectory groups (%d of %d held); prompt stream: %d unread, %d in work%s",
            waited_s,
            len(self.groups),
            need,
            prompts.lag,
            prompts.pending,
            why,
        )

    def give_back(self, groups: list[TrajectoryGroup], entries: list[Entry]) -> None:
        """Groups of a failed step: first in line for the next batch (still pending, kept alive here)."""
        back = [(g, e) for g, e in zip(groups, entries, strict=True) if g.group_id not in self.seen]
        self.seen.update(g.group_id for g, _ in back)
        self.groups[:0] = [g for g, _ in back]
        self.entries[:0] = [e for _, e in back]

    def reach(self, max_staleness: int) -> int:
        """How many groups are held at most: `max_staleness` + 1 steps' worth (the stream's length if
        shorter), as many as could still be trained before going stale."""
        steps = max_staleness + 1
        return max(
            self.cfg.prompts_per_step,
            min(self.bus.settings.trajectory_maxlen, steps * self.cfg.prompts_per_step),
        )

    def read_ahead(self, version: int, max_staleness: int) -> bool:
        """Take what is waiting, as far as groups can still be trained: `max_staleness` + 1 steps' worth
        (bounded, as a batch of long completions is gigabytes; what lies beyond would go stale in hand).
        False when that much is held already. Held groups are kept alive."""
        ahead = self.reach(max_staleness) - len(self.groups)
        self.keep_alive()
        if ahead > 0:
            self._read(version, ahead, 0, max_staleness)
        return ahead > 0

    def start_read_ahead(self) -> None:
        """With `learner.read_ahead_mb`, the stream is read, decoded and validated on a thread of its own
        from now on, a step's groups ahead, while the loop trains (prefetch.py)."""
        if self.cfg.read_ahead_mb > 0 and self.prefetch is None:
            budget = self.cfg.read_ahead_mb << 20
            self.prefetch = Prefetch(self.bus, CONSUMER, self.cfg.prompts_per_step, budget, self._in_hand)
            self.prefetch.start()

    def _in_hand(self) -> list[str]:
        """The entries held and those of the batch handed out last (trained now, or acknowledged)."""
        return [e.entry_id for e in [*self.entries, *self.handed]]

    def stop_read_ahead(self) -> None:
        if self.prefetch is not None:
            self.prefetch.stop()

    def _read(self, version: int, count: int, block_ms: int | None, max_staleness: int) -> None:
        if self.prefetch is not None:
            wait = self.bus.settings.block_ms if block_ms is None else block_ms
            read = self.prefetch.take(count, wait)
        else:
            read = self.bus.read_decoded("trajectories", CONSUMER, count, decode_group, block_ms)
        # The trained marks of the whole read in one round trip: looked up group by group, each lookup
        # waited its turn in Redis behind the fleet's publishes, which capped the intake (ledger.py).
        replays = trained_among(self.bus, [group.group_id for _, group in read])
        aside: list[tuple[Entry, TrajectoryGroup]] = []
        for entry, group in read:
            if self._take(entry, group, version, group.group_id in replays):
                aside.append((entry, group))
        if aside:
            self._set_aside(aside, version)
        # Held groups age as the version moves on: those past reach are sent back to be made again.
        stale = [
            i
            for i, g in enumerate(self.groups)
            if too_stale(self._oldest(g, version), version, max_staleness)
        ]
        for i in reversed(stale):
            group = self.groups[i]
            self.acked += self.bus.send_back(
                self.entries[i], group.prompt.prompt_id, encode_message(group.prompt)
            )
            self.dropped += 1
            self.seen.discard(group.group_id)
            self.oldest.pop(group.group_id, None)  # its prompt is made again, maybe under the same id
            del self.groups[i], self.entries[i]
        if stale:
            log.info(
                "%d groups older than max_staleness %d (learner at version %d): their prompts go back to "
                "the feed, to be made again",
                len(stale),
                max_staleness,
                version,
            )

    def _from_another_lineage(self, group: TrajectoryGroup, version: int) -> str | None:
        """Staleness is two-sided: a group sampled by a version this learner never produced (ahead of it,
        or one a resume discarded) was sampled by weights that no longer exist."""
        versions = {int(v) for c in group.completions if c.num_tokens for v in c.policy_versions.tolist()}
        newest = max(versions, default=None)
        if newest is not None and newest > version:
            return f"sampled by policy version {newest}, which this learner (at {version}) has not produced"
        for lo, hi in self.void_versions:
            if any(lo <= v <= hi for v in versions):
                return f"sampled by a policy version in {lo}..{hi}, which a resume discarded"
        return None

    def take_acked(self) -> int:
        """The entries acknowledged here since the last call (for the step's count)."""
        acked, self.acked = self.acked, 0
        return acked

    def keep_alive(self) -> None:
        """Entries held across reads (or a pause) would otherwise be reclaimed and re-delivered when idle."""
        self.bus.touch("trajectories", CONSUMER, [e.entry_id for e in self.entries])

    def _take(self, entry: Entry, group: TrajectoryGroup, version: int, replay: bool) -> bool:
        """Hold a group read off the stream; `replay`: a step trained on it already (its mark is set).
        True: an uninformative group to set aside (`_set_aside`), not held."""
        if group.group_id in self.seen:
            return False
        problem = group_problem(group, self.limits) or self._from_another_lineage(group, version)
        if problem is not None:
            self.dead_lettered += self.bus.dead_letter("trajectories", entry, problem)
            return False
        if replay:
            self.acked += self.bus.ack("trajectories", [entry.entry_id])  # a replay: trained already
            return False
        if filtered(group, self.cfg):
            return True
        self.seen.add(group.group_id)
        self.groups.append(group)
        self.entries.append(entry)
        return False

    def _oldest(self, group: TrajectoryGroup, version: int) -> int:
        """The held group's oldest policy version; `version` when it generated nothing (nothing can be
        stale)."""
        if group.group_id not in self.oldest:
            self.oldest[group.group_id] = group.oldest_policy_version
        oldest = self.oldest[group.group_id]
        return version if oldest is None else oldest

    def _set_aside(self, aside: list[tuple[Entry, TrajectoryGroup]], version: int) -> None:
        """Uninformative groups, used at once: recorded as filtered, marked, acknowledged (FilteredLog)."""
        if self.filtered_log is None:
            raise RuntimeError("learner.filter_groups: the collector has no FilteredLog to record groups in")
        entries, groups = [e for e, _ in aside], [g for _, g in aside]
        self.acked += self.filtered_log.set_aside(groups, entries, version)
        self.filtered += len(groups)
