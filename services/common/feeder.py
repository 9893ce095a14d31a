"""The prompt feeder: a dataset or task → the prompt stream, with back-pressure and idempotent ids."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sparkrl.proto import Prompt, encode_message, group_id_for
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.recovery import TRAINED_PREFIX, incarnation

log = logging.getLogger("sparkrl.feeder")


@dataclass(frozen=True)
class FeedReport:
    """What one feeding pass did."""

    published: int  # new prompts added to the stream
    duplicates: int  # prompt ids already fed earlier (a re-run), skipped by the bus
    seconds: float


FEED_DONE = "feed_done"  # named value: the feeder fed all it had (JSON: prompts, epochs, time)


def mark_feeding(bus: RedisBus) -> None:
    """A feed is under way: an earlier feed's done mark (a resumed run's bus) must not end the run."""
    bus.set_value(FEED_DONE, "")


def mark_fed(bus: RedisBus, report: FeedReport, epochs: int) -> None:
    """Tell the learner the data is all in the stream: once it is trained, the run is over."""
    done = {"prompts": report.published + report.duplicates, "epochs": epochs, "time": time.time()}
    bus.set_value(FEED_DONE, json.dumps(done))


def feed_prompts(
    bus: RedisBus,
    prompts: Iterable[Prompt],
    epoch: int = 0,
    log_every: int = 1000,
    skip_trained: bool = False,
    stop: threading.Event | None = None,
) -> FeedReport:
    """Publish each prompt once. `epoch` > 0 re-feeds the same data as new prompts (`id@epoch`);
    `skip_trained` leaves out prompts whose group the learner has trained (after a Redis wipe)."""
    start = time.monotonic()
    published = duplicates = 0
    for prompt in prompts:
        if stop is not None and stop.is_set():
            break
        if epoch:
            prompt = prompt.model_copy(update={"prompt_id": f"{prompt.prompt_id}@{epoch}"})
        if skip_trained and bus.get_value(TRAINED_PREFIX + group_id_for(prompt.prompt_id)) is not None:
            duplicates += 1
            continue
        # Blocks while the stream is full (bus.prompt_maxlen): the fleet sets the pace.
        if bus.publish_prompt(prompt.prompt_id, encode_message(prompt)):
            published += 1
        else:
            duplicates += 1
        if (published + duplicates) % log_every == 0:
            log.info("fed %d prompts (%d already fed)", published, duplicates)
    return FeedReport(published, duplicates, time.monotonic() - start)


def watch_and_refeed(
    bus: RedisBus, feed_all: Callable[[], FeedReport], stop: threading.Event, known: str, poll_s: float = 2.0
) -> None:
    """After feeding: until stopped, feed again whenever the learner reports a new incarnation of the bus
    (it lost its data and the learner rebuilt the trained marks), leaving out what was trained. `known`
    is the incarnation taken (`ensure_incarnation`) before the first feed, so a wipe during it counts."""
    while not stop.wait(poll_s):
        now = incarnation(bus)
        if now is None or now == known:
            continue  # unchanged, or wiped and the learner has not rebuilt its marks yet
        log.warning("the bus lost its data (new incarnation %s): feeding again what was not trained", now)
        known = now
        report = feed_all()
        log.info("fed %d prompts again (%d trained or present)", report.published, report.duplicates)
