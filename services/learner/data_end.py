"""When the data is the limit: how the prompts fed ended (the end reason and `ended.json`'s counts), and
how many steps the data still allows (the learner's status: the progress line's and the page's total).

Each feeder marks its feed done with how many prompts it fed (`feeds_done` adds them up); the learner's
train state counts the groups trained and the stale ones sent back; the dead-letter stream holds the
prompts the workers and the groups the learner set aside. Every prompt fed is one of trained,
dead-lettered or (the rest, which sending stale groups back leaves empty) dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from sparkrl.proto.run_files import PromptCounts
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.feeder import feeds_done


class Progress(Protocol):
    """What the learner's train state (`TrainState`) tells about the data used so far."""

    step: int
    groups_trained: int
    groups_filtered: int  # uninformative groups used, not trained (learner.filter_groups)
    groups_dropped_stale: int  # stale groups sent back to be made again (their prompts fed again)


@dataclass
class Tally:
    """A `Progress` of its own, for a collector that runs without a learner (tests, tools)."""

    step: int = 0
    groups_trained: int = 0
    groups_filtered: int = 0
    groups_dropped_stale: int = 0


@dataclass(frozen=True)
class Fed:
    """The feeder's done mark: everything is in the prompt stream."""

    prompts: int
    epochs: int


def feed_done(bus: RedisBus) -> Fed | None:
    """What the feeders fed, once each fed all it had; None while a feed is under way (or none was)."""
    total = feeds_done(bus)
    return None if total is None else Fed(total.prompts, total.epochs)


def count_prompts(bus: RedisBus, fed: Fed, progress: Progress, filtered: int = 0) -> PromptCounts:
    """How the prompts fed ended, from the train state, the groups filtered (`filtered`: the filter's
    record, which a crash between checkpoints does not roll back) and the dead-letter stream (so the
    count covers every process and restart of the run; a trimmed stream gives "at least")."""
    letters = bus.dead_letters(count=bus.settings.dead_letter_maxlen)
    by_stream: dict[str, set[str]] = {bus.stream_key("prompts"): set(), bus.stream_key("trajectories"): set()}
    for letter in letters:
        by_stream.get(letter.stream, set()).add(letter.item_id)
    prompts, groups = (len(ids) for ids in by_stream.values())
    trained = progress.groups_trained
    return PromptCounts(
        fed=fed.prompts,
        epochs=fed.epochs,
        trained=trained,
        filtered=filtered,
        dead_lettered_prompts=prompts,
        dead_lettered_groups=groups,
        dead_letters_trimmed=len(letters) >= bus.settings.dead_letter_maxlen,
        dropped=max(0, fed.prompts - trained - filtered - prompts - groups),
        sampled_again=progress.groups_dropped_stale,
    )


def end_reason(counts: PromptCounts) -> str:
    """The run's end reason once the data ran out, with how its prompts ended."""
    epochs = f"{counts.epochs} epoch{'s' if counts.epochs != 1 else ''}"
    again = counts.sampled_again
    stale = f"; {again} went stale first and were made again" if again else ""
    dead = counts.dead_lettered_prompts + counts.dead_lettered_groups
    if not dead and not counts.dropped and counts.filtered:
        return (
            f"the data ran out: all {counts.fed} prompts fed ({epochs}) were used, {counts.trained} trained "
            f"and {counts.filtered} filtered (all their answers scored alike){stale}"
        )
    if not dead and not counts.dropped:
        return f"the data ran out: all {counts.fed} prompts fed ({epochs}) were trained{stale}"
    some = "at least " if counts.dead_letters_trimmed else ""
    also = f"{counts.filtered} filtered, " if counts.filtered else ""
    return (
        f"the data ran out: of the {counts.fed} prompts fed ({epochs}), {counts.trained} were trained, "
        f"{also}{some}{dead} dead-lettered ({counts.dead_lettered_prompts} prompts by the workers, "
        f"{counts.dead_lettered_groups} groups by the learner; `sparkrl dead` lists them with the reason) "
        f"and {counts.dropped} dropped (neither trained nor dead-lettered){stale}"
    )


def steps_the_data_allows(bus: RedisBus, prompts_per_step: int, progress: Progress) -> int | None:
    """The steps taken plus those the prompts not yet used make (a step takes `prompts_per_step`); None
    while the feed is under way. A read-ahead step that takes more, or a dead letter, brings it down."""
    fed = feed_done(bus)
    if fed is None:
        return None
    # Read from another thread while a step is committed: its step may be counted before its groups are
    # (learner.step), which would promise one step too many; a step trains prompts_per_step groups.
    trained = max(progress.groups_trained, progress.step * prompts_per_step)
    used = trained + progress.groups_filtered
    left = max(0, fed.prompts - used - bus.dead_letter_count())
    return progress.step + math.ceil(left / prompts_per_step)
