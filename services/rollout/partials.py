"""Partial rollouts (`rollout.partial`): a worker that stops mid-generation hands its unfinished groups over
instead of dropping them, and the worker that takes a prompt next continues its samples.

Handing over: the engine stops at the next decoding step (its rows come back cut short, `finish_reason`
abort); each group of the batch is saved as a `PartialGroup` under `{ns}:value:partial:<group id>`, then
the prompts are released (`RedisBus.release`: reclaimable at once, the delivery count unchanged). The
prompt is never acknowledged in between, so its delivery, its group id and the exactly-once contract are
the ones of any prompt a worker leaves behind; a worker killed before it saved leaves its prompts to be
reclaimed after `bus.claim_idle_ms` and made from scratch, as before.

Taking over: a worker looks each prompt it takes up; a record that fits its request (the same
tokenization, n, top-k and sampling) gives the engine its samples as prefixes — finished ones kept, the
rest continued from their last token (their tokens, versions and log-probs kept, the cache recomputed under
its own weights). A sample whose oldest token is further behind the worker's version than the bound (the
per-token staleness of `rollout.partial.max_staleness`, or the learner's max_staleness) is made again from
the prompt, counted. The group it publishes says what it continued (`resumed_tokens`, `resumed_from`), and
the record is deleted once the group is published.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sparkrl.proto import (
    Completion,
    PartialGroup,
    SamplingParams,
    TrajectoryGroup,
    decode_message,
    encode_message,
    group_id_for,
    staleness,
)
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import SamplingSettings
from sparkrl.services.common.settings.rollout import PartialSettings
from sparkrl.services.rollout.batch import PromptBatch
from sparkrl.services.rollout.engine import Prefixes
from sparkrl.services.rollout.metrics import WorkerMetrics

log = logging.getLogger("sparkrl.rollout")


def partial_key(group_id: str) -> str:
    return f"partial:{group_id}"


@dataclass
class Taken:
    """The partial work found for a batch's prompts."""

    prefixes: dict[str, list[Completion | None]] = field(default_factory=dict)  # by prompt id
    producers: dict[str, str] = field(default_factory=dict)  # by prompt id: whose work it continues
    found: set[str] = field(default_factory=set)  # group ids with a record, deleted once published
    continued: int = 0  # samples continued (or kept, finished) from saved work
    discarded: int = 0  # samples with saved work made again from the prompt: too stale, or not fitting

    def prefixes_for(self, batch: PromptBatch) -> Prefixes | None:
        """The engine's `prefixes` for `batch` (None when nothing of it is continued)."""
        if not any(p.prompt_id in self.prefixes for p in batch.prompts):
            return None
        return [self.prefixes.get(p.prompt_id) or [] for p in batch.prompts]

    def annotate(self, group: TrajectoryGroup) -> TrajectoryGroup:
        """The group as published: which of its samples' leading tokens were continued, from whom."""
        prefixes = self.prefixes.get(group.prompt.prompt_id)
        if prefixes is None:
            return group
        resumed = [0 if p is None else p.num_tokens for p in prefixes]
        return group.model_copy(
            update={"resumed_tokens": resumed, "resumed_from": self.producers[group.prompt.prompt_id]}
        )

    def spent(self) -> Taken:
        """For the groups made again (they would reach the learner too stale): from their prompts, the
        records still to delete."""
        return Taken(found=set(self.found))

    def oldest(self, version: int | None) -> int | None:
        """The oldest version of the tokens in hand once the engine starts at `version`."""
        kept = [int(p.policy_versions.min()) for g in self.prefixes.values() for p in g if p and p.num_tokens]
        return min([*kept, version]) if version is not None else (min(kept) if kept else None)


@dataclass
class Handover:
    """A worker's side of partial rollouts: `take` the work saved for the prompts it pulls, `save` what it
    stops with, forget the records of groups it `published`."""

    bus: RedisBus
    cfg: PartialSettings
    worker_id: str
    vocab_size: int
    continues: bool  # the engine continues prefixes (`Engine.continues_prefixes`); else all made again
    version: Callable[[], int]  # the policy version the engine holds
    learner_bound: Callable[[], int | None]  # the learner's max_staleness in force, from its status
    metrics: WorkerMetrics

    def take(self, batch: PromptBatch, sampling: SamplingSettings) -> Taken:
        if not self.cfg.enabled:
            return Taken()
        bound = self.cfg.max_staleness if self.cfg.max_staleness is not None else self.learner_bound()
        taken = take(self.bus, batch, sampling, self.vocab_size, self.version(), bound)
        if taken.prefixes and not self.continues:
            taken = Taken(found=taken.found, discarded=taken.discarded + taken.continued)
        if taken.found:
            log.info("continuing %d samples of %d groups from saved partial work (%d made again)",
                     taken.continued, len(taken.found), taken.discarded)  # fmt: skip
            self.metrics.partial_continued.inc(taken.continued)
            self.metrics.partial_discarded.inc(taken.discarded)
        return taken

    def save(
        self, batch: PromptBatch, completions: list[list[Completion]], sampling: SamplingSettings
    ) -> None:
        """Hand `batch` over: saved, its prompts released (partial rollouts off: left to be reclaimed)."""
        if not self.cfg.enabled:
            log.warning("leaving %d prompts to be reclaimed", len(batch.prompts))
            return
        ttl_s = self.cfg.ttl_s
        saved = save(self.bus, batch, completions, sampling, self.worker_id, self.vocab_size, ttl_s)
        unfinished = sum(c.finish_reason == "abort" for group in completions for c in group)
        self.metrics.partial_saved.inc(len(saved))
        log.info("handed %d groups over (%d samples unfinished; %d prompts released): %s", len(saved),
                 unfinished, len(batch.prompts), " ".join(saved))  # fmt: skip

    def published(self, group_ids: list[str], taken: Taken) -> None:
        done = taken.found.intersection(group_ids)
        if done:
            forget(self.bus, done)


def fill_gaps(prefixes: Prefixes, n: int) -> Prefixes:
    """A prompt without saved work gets n fresh samples (the engine wants n entries for every prompt)."""
    return [group or [None] * n for group in prefixes]


def save(
    bus: RedisBus,
    batch: PromptBatch,
    completions: list[list[Completion]],
    sampling: SamplingSettings,
    worker_id: str,
    vocab_size: int,
    ttl_s: float,
) -> list[str]:
    """Save each group of `batch` as far as it got, then release its prompts; the group ids saved (a group
    with no token yet is not: the next worker starts it from the prompt either way)."""
    records: dict[str, str] = {}
    params = SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, max_new_tokens=sampling.max_new_tokens
    )
    for prompt, prompt_ids, group in zip(batch.prompts, batch.token_ids, completions, strict=True):
        if not any(c.num_tokens for c in group):
            continue
        record = PartialGroup(
            group_id=group_id_for(prompt.prompt_id),
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            completions=group,
            producer=worker_id,
            vocab_size=vocab_size,
            topk=sampling.topk_logprobs,
            sampling=params,
            saved_at=time.time(),
        )
        records[record.group_id] = encode_message(record).decode()
    if records:  # saved before released: a prompt taken is never without its record
        bus.set_values({partial_key(g): v for g, v in records.items()}, ttl_s=ttl_s)
    bus.release("prompts", worker_id, [e.entry_id for e in batch.entries])
    return list(records)


def take(
    bus: RedisBus,
    batch: PromptBatch,
    sampling: SamplingSettings,
    vocab_size: int,
    version: int,
    max_staleness: int | None,
) -> Taken:
    """The saved work of `batch`'s prompts that this worker continues (holding policy `version`; a sample
    older than `max_staleness` versions is made again, None: no bound)."""
    taken = Taken()
    group_ids = [group_id_for(p.prompt_id) for p in batch.prompts]
    raws = bus.get_values([partial_key(g) for g in group_ids])
    for prompt, prompt_ids, group_id, raw in zip(
        batch.prompts, batch.token_ids, group_ids, raws, strict=True
    ):
        if raw is None:
            continue
        taken.found.add(group_id)
        try:
            record = decode_message(raw, PartialGroup)
        except Exception as exc:  # a record of another build: the group is made from its prompt
            log.warning("partial work of %s unreadable (%s): made from the prompt", group_id, exc)
            taken.discarded += sampling.n
            continue
        why = misfit(record, prompt_ids, sampling, vocab_size)
        if why is not None:
            log.info("partial work of %s not continued (%s): made from the prompt", group_id, why)
            taken.discarded += sampling.n
            continue
        kept = [usable(c, version, max_staleness) for c in record.completions]
        taken.discarded += sum(
            p is None and c.num_tokens > 0 for p, c in zip(kept, record.completions, strict=True)
        )
        if any(p is not None for p in kept):
            taken.prefixes[prompt.prompt_id], taken.producers[prompt.prompt_id] = kept, record.producer
            taken.continued += sum(p is not None for p in kept)
    return taken


def misfit(record: PartialGroup, prompt_ids: list[int], sampling: SamplingSettings, vocab: int) -> str | None:
    """Why saved work cannot be continued by this request, or None."""
    if record.prompt_token_ids.tolist() != list(prompt_ids):
        return "the prompt tokenizes differently here"
    if len(record.completions) != sampling.n:
        return f"{len(record.completions)} samples, this worker makes {sampling.n}"
    if (record.topk, record.vocab_size) != (sampling.topk_logprobs, vocab):
        here = f"top-{sampling.topk_logprobs} over {vocab}"
        return f"top-{record.topk} over {record.vocab_size} ids, here {here}"
    made = record.sampling
    if (made.temperature, made.top_p, made.max_new_tokens) != (
        sampling.temperature,
        sampling.top_p,
        sampling.max_new_tokens,
    ):
        return "sampled with other values (temperature, top_p, max_new_tokens)"
    return None


def usable(sample: Completion, version: int, max_staleness: int | None) -> Completion | None:
    """The saved sample as a prefix, or None (made again) when its oldest token is too stale."""
    if not sample.num_tokens:
        return None
    oldest = int(sample.policy_versions.min())
    if max_staleness is not None and staleness.too_stale(oldest, version, max_staleness):
        return None
    return sample


def forget(bus: RedisBus, group_ids: set[str]) -> None:
    """Delete the records of groups now published."""
    bus.delete_values([partial_key(g) for g in sorted(group_ids)])
