"""A batch's groups out: each published (idempotently, by group id), then its prompt acknowledged; and the
worker's check that a group would still be trained when it arrives."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from sparkrl.proto import LearnerStatus, TrajectoryGroup, encode_group, staleness
from sparkrl.proto.codec import Wire
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
    wire: Wire | None = None,
) -> Published:
    """Publish each group (encoded as `wire` says: `rollout.wire`), then ack its prompt.

    The batch goes out in two round trips: every group that is not doomed is offered at once, then the
    prompts of those the bus took (or had: a replay is dropped by the bus, yet acked) are acknowledged
    together. A group the full stream refused is published alone after that (`publish_waiting`). A
    group `doomed` (it would reach the learner too stale to train on) is not published: its prompt stays
    in hand, for the caller to generate again. Groups neither done nor to redo were left unpublished.
    """
    redo = [i for i, group in enumerate(groups) if doomed(group)]
    offered = sorted(set(range(len(groups))) - set(redo))
    now = time.time()
    payloads = [encode_group(groups[i].model_copy(update={"published_at": now}), wire) for i in offered]
    taken = bus.publish_groups_once([(groups[i].group_id, p) for i, p in zip(offered, payloads, strict=True)])
    done = [i for i, took in zip(offered, taken, strict=True) if took is not None]
    bus.ack("prompts", [entries[i].entry_id for i in done])
    new = sum(1 for took in taken if took)
    refused = [i for i, took in zip(offered, taken, strict=True) if took is None]
    if refused:
        later = publish_waiting(bus, [groups[i] for i in refused], [entries[i] for i in refused], stop,
                                waiting, doomed, wire)  # fmt: skip
        new += later.new
        done += [refused[i] for i in later.done]
        redo += [refused[i] for i in later.redo]
    return Published(new, sorted(done), sorted(redo))


def publish_waiting(
    bus: RedisBus,
    groups: list[TrajectoryGroup],
    entries: list[Entry],
    stop: threading.Event,
    waiting: Callable[[int], None],
    doomed: Callable[[TrajectoryGroup], bool],
    wire: Wire | None = None,
) -> Published:
    """Publish the groups one by one into a stream that may be full, each prompt acked once its group is
    in: while the stream is full (the learner sets the pace, or is paused) this waits in short slices,
    calling `waiting(groups still in hand)` between them (control commands are answered, weights followed)
    and honouring a stop; groups left unpublished keep their prompts unacked (the caller hands them over,
    or leaves them to be reclaimed). A group that became doomed while it waited is not published."""
    new, done, redo = 0, [], []
    for index, (group, entry) in enumerate(zip(groups, entries, strict=True)):
        deadline = time.monotonic() + bus.settings.publish_timeout_s
        while True:
            if doomed(group):
                redo.append(index)
                break
            payload = encode_group(group.model_copy(update={"published_at": time.time()}), wire)
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
