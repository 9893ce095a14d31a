"""The feed-done mark is per feeder (issue 45): a one-off `sparkrl prompts` into a live run neither
overwrites the run's feeder's mark nor ends the run while it feeds; the learner reads every feeder's mark
added up, once all are done."""

from __future__ import annotations

from pathlib import Path

from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.feeder import FeedReport, feeder_name, feeds_done, mark_fed, mark_feeding
from sparkrl.services.common.settings import BusSettings, PromptSettings
from sparkrl.services.learner.data_end import Fed, feed_done


def test_a_one_off_feed_keeps_the_runs_mark_and_holds_the_end_while_it_feeds(
    bus_settings: BusSettings,
) -> None:
    with RedisBus(bus_settings) as bus:
        assert feed_done(bus) is None  # nothing fed yet
        mark_feeding(bus, "run")
        assert feed_done(bus) is None
        mark_fed(bus, FeedReport(published=64, duplicates=0, seconds=1.0), epochs=2, feeder="run")
        assert feed_done(bus) == Fed(prompts=64, epochs=2)
        mark_feeding(bus, "one-off")  # a one-off `sparkrl prompts` begins: the run's data is not all in
        assert feed_done(bus) is None
        mark_fed(bus, FeedReport(published=1, duplicates=0, seconds=0.1), epochs=1, feeder="one-off")
        assert feed_done(bus) == Fed(prompts=65, epochs=2)  # both counted; the run's mark as it was
        # The run's feeder again (a resumed run): its own mark is replaced, the one-off's kept.
        mark_feeding(bus, "run")
        assert feed_done(bus) is None
        mark_fed(bus, FeedReport(published=0, duplicates=64, seconds=0.5), epochs=2, feeder="run")
        total = feeds_done(bus)
        assert total is not None and (total.prompts, total.feeders) == (65, 2)


def test_a_feeds_name_follows_the_data_it_feeds(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    run = PromptSettings(task="math", path=str(data))
    assert feeder_name(run, 1) == feeder_name(run.model_copy(), 1)  # the same feed again: its own mark
    assert feeder_name(run, 1).startswith("train.jsonl-")
    other = PromptSettings(task="math", path=str(tmp_path / "extra.jsonl"))
    names = {feeder_name(run, 1), feeder_name(run, 2), feeder_name(other, 1)}
    countdown = PromptSettings(task="countdown", seed=2)
    names |= {feeder_name(countdown, 1), feeder_name(countdown.model_copy(update={"seed": 3}), 1)}
    assert len(names) == 5 and feeder_name(countdown, 1).startswith("countdown-s2-")
