"""The prompt feeder: a dataset or task → the prompt stream, with back-pressure and idempotent ids."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from sparkrl.proto import Prompt, encode_message
from sparkrl.services.common.bus import RedisBus

log = logging.getLogger("sparkrl.feeder")


@dataclass(frozen=True)
class FeedReport:
    """What one feeding pass did."""

    published: int  # new prompts added to the stream
    duplicates: int  # prompt ids already fed earlier (a re-run), skipped by the bus
    seconds: float


def feed_prompts(
    bus: RedisBus, prompts: Iterable[Prompt], epoch: int = 0, log_every: int = 1000
) -> FeedReport:
    """Publish each prompt once. `epoch` > 0 re-feeds the same data as new prompts (`id@epoch`)."""
    start = time.monotonic()
    published = duplicates = 0
    for prompt in prompts:
        if epoch:
            prompt = prompt.model_copy(update={"prompt_id": f"{prompt.prompt_id}@{epoch}"})
        # Blocks while the stream is full (bus.prompt_maxlen): the fleet sets the pace.
        if bus.publish_prompt(prompt.prompt_id, encode_message(prompt)):
            published += 1
        else:
            duplicates += 1
        if (published + duplicates) % log_every == 0:
            log.info("fed %d prompts (%d already fed)", published, duplicates)
    return FeedReport(published, duplicates, time.monotonic() - start)
