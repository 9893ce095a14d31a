"""Partial rollouts' records on a real redis-server (`services/rollout/partials.py`): a stopped worker's
groups saved and their prompts released, another worker taking them up as prefixes, the bound on how old a
continued prefix may be, work that does not fit refused, the record's expiry and its deletion once the
group is published."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import redis

from sparkrl.proto import Completion, Prompt, TrajectoryGroup, decode_message, group_id_for
from sparkrl.proto.testing import random_group
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.feeder import feed_prompts
from sparkrl.services.common.settings import BusSettings, SamplingSettings
from sparkrl.services.common.settings.rollout import PartialSettings
from sparkrl.services.rollout.batch import PromptBatch
from sparkrl.services.rollout.engine import cut_short, make_completion
from sparkrl.services.rollout.metrics import WorkerMetrics
from sparkrl.services.rollout.partials import Handover, fill_gaps, partial_key, save, take

VOCAB, K, N = 300, 4, 3
SAMPLING = SamplingSettings(n=N, temperature=1.0, max_new_tokens=16, topk_logprobs=K)


def sample(T: int, versions: list[int] | int, finish: str = "abort") -> Completion:
    """T tokens (ids 1..T) tagged with `versions` (one per token, or one for all)."""
    ids = np.arange(1, T + 1)
    topk_ids = np.stack([(ids + j) % VOCAB for j in range(K)], axis=1)  # [T, K], distinct per row
    topk_logp = np.tile(np.log([0.4, 0.3, 0.2, 0.1]), (T, 1))  # [T, K], sorted descending
    return make_completion(ids, topk_logp[:, 0], topk_ids, topk_logp, np.asarray(versions), "", finish)


def pulled(bus: RedisBus, count: int, consumer: str = "worker-0") -> PromptBatch:
    """`count` fresh prompts fed, then taken by `consumer` as a worker takes them (tokens made up)."""
    prompts = [Prompt(prompt_id=f"p/{i}", task="countdown", text=f"prompt {i}") for i in range(count)]
    assert feed_prompts(bus, prompts).published == count
    entries = bus.read_decoded("prompts", consumer, count, lambda raw: decode_message(raw, Prompt), 0)
    assert len(entries) == count
    return PromptBatch(
        [e for e, _ in entries], [p for _, p in entries], [[5, 6, 7 + i] for i in range(count)]
    )


@pytest.fixture
def bus(bus_settings: BusSettings) -> Iterator[RedisBus]:
    # A long claim_idle_ms: an entry another consumer takes at once was released, not timed out.
    with RedisBus(bus_settings.model_copy(update={"claim_idle_ms": 60_000})) as bus:
        yield bus


def handover(
    bus: RedisBus, worker: str, version: int, learner_bound: int | None = None, **cfg: object
) -> Handover:
    continues = bool(cfg.pop("continues", True))
    return Handover(bus, PartialSettings(**cfg), worker, VOCAB, continues, lambda: version,
                    lambda: learner_bound, WorkerMetrics(worker))  # fmt: skip


def test_a_saved_group_is_released_then_continued_by_another_worker_from_its_tokens(bus: RedisBus) -> None:
    batch = pulled(bus, 2)
    work = [
        [sample(5, [0, 0, 1, 1, 1]), sample(3, 0, "stop"), cut_short(None, K)],  # cut short, finished, none
        [sample(2, 1), sample(4, 1), sample(1, 1)],
    ]
    handover(bus, "worker-0", version=1).save(batch, work, SAMPLING)

    # Released: another worker takes both prompts at once (not after claim_idle_ms), the same deliveries.
    again = bus.read("prompts", "worker-1", 10, block_ms=0)
    assert sorted(e.entry_id for e in again) == sorted(e.entry_id for e in batch.entries)
    assert all(e.deliveries == 2 for e in again)
    assert bus.read("prompts", "worker-2", 10, block_ms=0) == []  # taken, now held by worker-1

    later = PromptBatch(again, batch.prompts, batch.token_ids)  # read in feed order, as `pulled` did
    later.entries.sort(key=lambda e: [p.prompt_id for p in batch.prompts].index(e.item_id))
    side = handover(bus, "worker-1", version=2)
    taken = side.take(later, SAMPLING)
    assert taken.found == {group_id_for("p/0"), group_id_for("p/1")}
    assert (taken.continued, taken.discarded) == (5, 0)  # the sample never started is not "made again"
    prefixes = fill_gaps(taken.prefixes_for(later), N)
    first = prefixes[0]
    assert first[2] is None  # started from the prompt
    assert first[0].finish_reason == "abort" and first[0].policy_versions.tolist() == [0, 0, 1, 1, 1]
    assert first[1].finish_reason == "stop"  # kept as it is
    for kept, saved in zip(first[:2], work[0][:2], strict=True):
        for name in ("token_ids", "logprobs", "topk_ids", "topk_logprobs", "policy_versions"):
            np.testing.assert_array_equal(getattr(kept, name), getattr(saved, name))
    assert taken.oldest(2) == 0

    group = random_group(np.random.default_rng(0), n=N, T=6, k=K, vocab_size=VOCAB, max_new_tokens=16)
    group = group.model_copy(update={"prompt": batch.prompts[0], "group_id": group_id_for("p/0")})
    annotated = TrajectoryGroup.model_validate(taken.annotate(group).model_dump())
    assert (annotated.resumed_tokens, annotated.resumed_from) == ([5, 3, 0], "worker-0")

    side.published([group_id_for("p/0")], taken)  # the group out: its record goes, the other's stays
    assert bus.get_values([partial_key(group_id_for(p)) for p in ("p/0", "p/1")])[0] is None
    assert bus.get_value(partial_key(group_id_for("p/1"))) is not None


def test_a_prefix_older_than_max_staleness_is_made_again_from_the_prompt(bus: RedisBus) -> None:
    batch = pulled(bus, 1)
    work = [[sample(4, [3, 3, 5, 5]), sample(4, 5), sample(4, [4, 4, 4, 6])]]
    save(bus, batch, work, SAMPLING, "worker-0", VOCAB, ttl_s=60)

    # Per token: a sample is as old as its oldest token. At version 6 with a bound of 2, 3 is too old.
    taken = take(bus, batch, SAMPLING, VOCAB, version=6, max_staleness=2)
    assert (taken.continued, taken.discarded) == (2, 1)
    assert [p is None for p in taken.prefixes["p/0"]] == [True, False, False]
    # None: no bound. A bound that every sample exceeds continues nothing, though the record is found.
    assert take(bus, batch, SAMPLING, VOCAB, version=6, max_staleness=None).continued == 3
    nothing = take(bus, batch, SAMPLING, VOCAB, version=9, max_staleness=0)
    assert (nothing.continued, nothing.discarded, nothing.prefixes) == (0, 3, {})
    assert nothing.prefixes_for(batch) is None and nothing.found == {group_id_for("p/0")}

    # rollout.partial.max_staleness, else the learner's max_staleness in force.
    assert handover(bus, "w", 6, learner_bound=100, max_staleness=2).take(batch, SAMPLING).discarded == 1
    assert handover(bus, "w", 6, learner_bound=1).take(batch, SAMPLING).discarded == 2
    assert handover(bus, "w", 6, learner_bound=None).take(batch, SAMPLING).discarded == 0
    assert handover(bus, "w", 6, enabled=False).take(batch, SAMPLING).found == set()
    # An engine that continues no prefix (vLLM): every saved sample made again, the record still deleted.
    vllm = handover(bus, "w", 6, continues=False).take(batch, SAMPLING)
    assert (vllm.continued, vllm.discarded, vllm.prefixes, vllm.found) == (0, 3, {}, {group_id_for("p/0")})


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"n": N + 1}, "samples"),
        ({"temperature": 0.7}, "sampled with other values"),
        ({"max_new_tokens": 32}, "sampled with other values"),
        ({"topk_logprobs": 2}, "top-"),
    ],
)
def test_work_that_does_not_fit_the_request_is_not_continued(
    bus: RedisBus, change: dict[str, object], why: str, caplog: pytest.LogCaptureFixture
) -> None:
    batch = pulled(bus, 1)
    save(bus, batch, [[sample(4, 0), sample(2, 0), sample(1, 0)]], SAMPLING, "worker-0", VOCAB, ttl_s=60)
    here = SAMPLING.model_copy(update=change)
    with caplog.at_level("INFO", "sparkrl.rollout"):
        taken = take(bus, batch, here, VOCAB, version=0, max_staleness=None)
    assert (taken.continued, taken.discarded, taken.prefixes) == (0, here.n, {})
    assert taken.found == {group_id_for("p/0")}  # deleted once the group made from the prompt is out
    assert why in caplog.text
    other_tokens = PromptBatch(batch.entries, batch.prompts, [[9, 9]])
    assert take(bus, other_tokens, SAMPLING, VOCAB, 0, None).prefixes == {}


def test_saved_work_expires_after_ttl_and_nothing_is_saved_for_a_group_not_started(
    bus: RedisBus, bus_settings: BusSettings
) -> None:
    batch = pulled(bus, 2)
    empty = [cut_short(None, K)] * N
    saved = save(bus, batch, [[sample(2, 0)] * N, empty], SAMPLING, "worker-0", VOCAB, ttl_s=0.5)
    assert saved == [group_id_for("p/0")]
    client = redis.Redis.from_url(bus_settings.url)
    key = f"{bus.settings.namespace}:value:{partial_key(group_id_for('p/0'))}"
    assert 0 < client.pttl(key) <= 500
    assert bus.get_value(partial_key(group_id_for("p/1"))) is None
    assert len(bus.read("prompts", "worker-1", 10, block_ms=0)) == 2  # both released all the same
    time.sleep(0.7)
    assert client.exists(key) == 0
    assert take(bus, batch, SAMPLING, VOCAB, version=0, max_staleness=None).found == set()
    client.close()


def test_unreadable_saved_work_is_made_again_from_the_prompt(bus: RedisBus) -> None:
    batch = pulled(bus, 1)
    bus.set_values({partial_key(group_id_for("p/0")): '{"schema_version": 99}'})
    taken = take(bus, batch, SAMPLING, VOCAB, version=0, max_staleness=None)
    assert (taken.continued, taken.discarded, taken.found) == (0, N, {group_id_for("p/0")})


def test_with_partial_rollouts_off_nothing_is_saved_and_prompts_wait_to_be_reclaimed(bus: RedisBus) -> None:
    batch = pulled(bus, 1)
    handover(bus, "worker-0", 0, enabled=False).save(batch, [[sample(2, 0)] * N], SAMPLING)
    assert bus.get_value(partial_key(group_id_for("p/0"))) is None
    assert bus.read("prompts", "worker-1", 10, block_ms=0) == []  # held until claim_idle_ms
