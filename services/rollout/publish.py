"""A batch's groups out: each published (idempotently, by group id), then its prompt acknowledged; and the
worker's check that a group would still be trained when it arrives."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from sparkrl.proto import LearnerStatus, TrajectoryGroup, encode_group, staleness
from sparkrl.services.common.bus import BusBackpressureTimeout, Entry, RedisBus
from sparkrl.services.common.telemetry import Telemetry

log = logging.getLogger("sparkrl.rollout")

PUBLISH_POLL_S = 0.25  # a full stream is retried in turns this long, answering control and stop between


class Published(NamedTuple):
    """What `publish_groups` did with a batch's groups (indices into it)."""

    new: int  # groups the bus took (a replay is not new)
    done: list[int]  # published (or replays) and acknowledged
    redo: list[int]  # doomed: not published, their prompts in hand to be made again


def publish_groups(
    bus: RedisBus,
    groups: list[TrajectoryGroup],
    entries: list[Entry],
    stop: threading.Event,
    waiting: Callable[[int], None],
    doomed: Callable[[TrajectoryGroup], bool] = lambda group: False,
) -> Published:
    """Publish each group, then ack its prompt.

    A replay is dropped by the bus, yet acked. While the trajectory stream is full (the learner sets the
    pace, or is paused) this waits in short slices, calling `waiting(groups still in hand)` between them
    (control commands are answered, weights followed) and honouring a stop; groups left unpublished keep
    their prompts unacked (the caller hands them over, or leaves them to be reclaimed). A group `doomed`
    (it would reach the learner too stale to train on) is not published: its prompt stays in hand, for the
    caller to generate again. Groups neither done nor to redo were left unpublished.
    """
    new, done, redo = 0, [], []
    for index, (group, entry) in enumerate(zip(groups, entries, strict=True)):
        deadline = time.monotonic() + bus.settings.publish_timeout_s
        while True:
            if doomed(group):
                redo.append(index)
                break
            payload = encode_group(group.model_copy(update={"published_at": time.time()}))
            try:
                new += bus.publish_group(group.group_id, payload, timeout_s=PUBLISH_POLL_S)
            except BusBackpressureTimeout:
                waiting(len(groups) - index)
                if stop.is_set() or time.monotonic() > deadline:
                    log.warning("trajectory stream full: %d groups left unpublished", len(groups) - index)
                    return Published(new, done, redo)
                continue
            bus.ack("prompts", [entry.entry_id])
            done.append(index)
            break
    return Published(new, done, redo)


def too_stale(learner: LearnerStatus | None, oldest: int | None) -> bool:
    """Whether a group whose oldest token is of policy version `oldest` is older than the learner's
    `max_staleness` (its status's typed field) against the version it holds now: the learner would not
    train it. Never when the learner is not live or does not say (a status from before the field), nor
    for a group without tokens (`oldest` None)."""
    if learner is None or oldest is None or not Telemetry.learner_alive(learner):
        return False
    if learner.max_staleness is None:
        return False
    return staleness.too_stale(oldest, learner.policy_version, learner.max_staleness)
