"""The prompt feeder: a dataset or task → the prompt stream, with back-pressure, idempotent ids, the
workers' prompt limits and a done mark per feeder; and the feed hold: a burst of dead letters stops the
fleet taking prompts instead of burning the data set."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from sparkrl.proto import Prompt, encode_message, group_id_for
from sparkrl.proto.telemetry import StateEvent
from sparkrl.services.common.bus import BusBackpressureTimeout, DeadLetter, RedisBus
from sparkrl.services.common.prompt_limits import REFUSALS_SAID, PromptLimits
from sparkrl.services.common.recovery import TRAINED_PREFIX, incarnation
from sparkrl.services.common.settings import PromptSettings
from sparkrl.services.common.telemetry import Telemetry

log = logging.getLogger("sparkrl.feeder")


@dataclass(frozen=True)
class FeedReport:
    """What one feeding pass did."""

    published: int  # new prompts added to the stream
    duplicates: int  # prompt ids already fed earlier (a re-run), skipped by the bus
    seconds: float
    refused: int = 0  # over the prompt limits (`overlong: drop`): never published


# ── the feed-done marks ───────────────────────────────────────────────────────────────────────────────
# One per feeder, so a one-off `sparkrl prompts` into a live run neither ends the run's feed nor hides
# it: the data is all in once every feeder that began has marked its feed done, and the prompts fed are
# their sum. A mark is a member of the bus's status board (kind `feed`, one set naming the feeders, one
# value each), kept as long as the prompt ids it counts are remembered (bus.dedup_ttl_s).
FEED_KIND = "feed"
DEFAULT_FEEDER = "feeder"


@dataclass(frozen=True)
class FeedTotal:
    """Every feeder's done mark together: the prompts they fed, and the most passes one made."""

    prompts: int
    epochs: int
    feeders: int


def feeder_name(cfg: PromptSettings, epochs: int) -> str:
    """A feed's name, from what decides its prompt ids: feeding the same data again (a restarted or
    resumed feeder) replaces its own mark; other data gets a mark of its own."""
    source = Path(cfg.path).resolve() if cfg.path is not None else f"countdown-s{cfg.seed}"
    identity = json.dumps([str(source), cfg.task, cfg.count, cfg.shuffle, cfg.seed, epochs])
    digest = hashlib.blake2b(identity.encode(), digest_size=4).hexdigest()
    return f"{Path(str(source)).name}-{digest}"


def _mark(bus: RedisBus, feeder: str, done: dict[str, object]) -> None:
    bus.put_status(FEED_KIND, feeder, json.dumps(done), ttl_s=bus.settings.dedup_ttl_s)


def mark_feeding(bus: RedisBus, feeder: str = DEFAULT_FEEDER) -> None:
    """A feed is under way: this feeder's earlier done mark (a resumed run's bus) must not end the run."""
    _mark(bus, feeder, {"state": "feeding", "time": time.time()})


def mark_fed(bus: RedisBus, report: FeedReport, epochs: int, feeder: str = DEFAULT_FEEDER) -> None:
    """Tell the learner this feeder's data is all in the stream: once every feed is trained, the run is
    over. Its count takes in what an earlier pass of the same feed published (its duplicates now)."""
    done = {"state": "fed", "prompts": report.published + report.duplicates, "epochs": epochs}
    _mark(bus, feeder, done | {"time": time.time()})


def feeds_done(bus: RedisBus) -> FeedTotal | None:
    """The feeders' marks added up, once every feeder that began is done; None while one is feeding (or
    none began). A mark that cannot be read counts as a feed under way."""
    marks = bus.statuses(FEED_KIND)
    if not marks:
        return None
    prompts = epochs = 0
    for feeder, raw in marks.items():
        try:
            done = json.loads(raw)
            if done.get("state") != "fed":
                return None
            prompts, epochs = prompts + int(done["prompts"]), max(epochs, int(done["epochs"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("feeder %s left an unreadable done mark: %r", feeder, raw[:200])
            return None
    return FeedTotal(prompts, epochs, len(marks))


def feed_prompts(
    bus: RedisBus,
    prompts: Iterable[Prompt],
    epoch: int = 0,
    log_every: int = 1000,
    skip_trained: bool = False,
    stop: threading.Event | None = None,
    limits: PromptLimits | None = None,
) -> FeedReport:
    """Publish each prompt once. `epoch` > 0 re-feeds the same data as new prompts (`id@epoch`);
    `skip_trained` leaves out prompts whose group the learner has trained (after a Redis wipe); `limits`
    (the workers' own, `prompt_limits.py`) refuses, or cuts, a prompt over their character bound."""
    start = time.monotonic()
    published = duplicates = refused = 0
    limits = limits or PromptLimits()
    for prompt in prompts:
        if stop is not None and stop.is_set():
            break
        if epoch:
            prompt = prompt.model_copy(update={"prompt_id": f"{prompt.prompt_id}@{epoch}"})
        bounded, why = limits.screen(prompt)
        if bounded is None:  # never published: dead-lettered with its reason, for `sparkrl dead`
            refused += 1
            bus.dead_letter_refused("prompts", prompt.prompt_id, f"refused by the feeder: {why}")
            if refused <= REFUSALS_SAID:
                more = "; more are counted, not said" if refused == REFUSALS_SAID else ""
                log.warning("not feeding prompt %s: %s%s", prompt.prompt_id, why, more)
            continue
        if skip_trained and bus.get_value(TRAINED_PREFIX + group_id_for(prompt.prompt_id)) is not None:
            duplicates += 1
            continue
        fresh = _publish_when_room(bus, bounded, stop)
        if fresh is None:
            break
        if fresh:
            published += 1
        else:
            duplicates += 1
        if (published + duplicates) % log_every == 0:
            log.info("fed %d prompts (%d already fed)", published, duplicates)
    return FeedReport(published, duplicates, time.monotonic() - start, refused)


FEED_POLL_S = 0.25  # how often a feeder blocked on a full prompt stream looks again
FEED_WAIT_S = 0.25  # one wait on a full stream, between looks at `stop` (its stop answers this fast)


def _publish_when_room(bus: RedisBus, prompt: Prompt, stop: threading.Event | None) -> bool | None:
    """Publish `prompt` once the stream has room (bus.prompt_maxlen: the fleet sets the pace), however
    long that takes — a paused or held run keeps the feeder waiting, not failing; True if new, False for
    a duplicate, None when `stop` came first. Looks again every FEED_POLL_S: a feeder waits most of a run."""
    payload = encode_message(prompt)
    while True:
        try:
            return bus.publish_prompt(prompt.prompt_id, payload, FEED_WAIT_S, poll_max_s=FEED_POLL_S)
        except BusBackpressureTimeout:
            if stop is not None and stop.is_set():
                return None
            log.debug("the prompt stream is full (bus.prompt_maxlen): still waiting for the fleet")


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


# ── the feed hold ─────────────────────────────────────────────────────────────────────────────────────

FEED_STATE = "feed_state"  # named value: the feed's last `StateEvent` (target `feed`): `held` or `flowing`
FEED_TARGET = "feed"


def feed_state(bus: RedisBus) -> StateEvent | None:
    """The feed's last change (None: never held); its `state` is `held` or `flowing`."""
    raw = bus.get_value(FEED_STATE)
    if not raw:
        return None
    try:
        return StateEvent.model_validate_json(raw)
    except ValueError:  # another build's or a hand edit: a hold nobody can read must not stop the fleet
        log.warning("ignoring a malformed feed state: %r", raw[:200])
        return None


def feed_held(bus: RedisBus) -> StateEvent | None:
    """The hold in force, or None when prompts flow."""
    state = feed_state(bus)
    return state if state is not None and state.state == "held" else None


def dead_letter_burst(bus: RedisBus, limit: int, window_s: float) -> list[DeadLetter] | None:
    """The newest prompt dead letters when more than `limit` of them fall within the last `window_s` (and
    after the feed last flowed again, so a lifted hold is not held again for the same burst); else None.

    The fleet's dead letters, not one worker's: a burst spread over many workers counts whole. The dead
    stream mixes both streams' letters, so twice the limit is read back (an approximation when the
    learner dead-letters groups in the same moments)."""
    state = feed_state(bus)
    since = max(time.time() - window_s, state.at if state is not None else 0.0)
    key = bus.stream_key("prompts")
    letters = bus.dead_letters(count=2 * (limit + 1))
    recent = [d for d in letters if d.stream == key and d.time_ms >= since * 1000]
    return recent if len(recent) > limit else None


def hold_feed(telemetry: Telemetry, by: str, detail: str) -> bool:
    """Hold the feed (no worker takes prompts until `resume`) and alert: a log line and a `StateEvent`
    on the telemetry channel; False when it was held already (the first worker to see a burst alerts)."""
    if feed_held(telemetry.bus) is not None:
        return False
    event = StateEvent(
        target=FEED_TARGET, state="held", previous="flowing", detail=detail[:2000], at=time.time()
    )
    telemetry.bus.set_value(FEED_STATE, event.model_dump_json())
    telemetry.append(event)
    log.error("FEED HELD by %s, no worker takes prompts: %s", by, detail)
    return True


def lift_feed_hold(telemetry: Telemetry, by: str) -> StateEvent | None:
    """Let prompts flow again (a `resume`); the hold that was lifted, or None when none was in force."""
    held = feed_held(telemetry.bus)
    if held is None:
        return None
    event = StateEvent(
        target=FEED_TARGET, state="flowing", previous="held", detail=f"lifted by {by}", at=time.time()
    )
    telemetry.bus.set_value(FEED_STATE, event.model_dump_json())
    telemetry.append(event)
    log.warning("feed hold lifted by %s (it was held: %s)", by, held.detail)
    return held
