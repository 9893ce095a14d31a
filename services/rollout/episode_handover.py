"""Partial rollouts across turns (issue 48, item 4): a worker that stops between two turns of a batch of
multi-turn episodes hands them over, and the worker that takes the prompts next plays them on.

Only where the episodes' environments are in an environment service (`rollout.agent.url`) and partial
rollouts are on (`rollout.partial.enabled`): the service holds each environment under its episode id for
`env.episode_idle_s`, so another worker can go on with it. An environment in the worker's own process dies
with it: such a worker finishes its batch of episodes before it stops, as before.

Handing over (`hand_over`): each group's episodes — their token streams as pieces (the model's turns as
sampled: tokens, log-probs, versions; the environment's tokens), their messages, how far each got — are
saved as a `PartialEpisodes` under `{ns}:value:episodes:<group id>` (`encode_message`), then the prompts
are released, never acknowledged in between: the delivery and the group id are the prompt's, so the group
is made once and trained once. Taking over (`take`): a record that fits (the same prompt tokens, n,
environment and service) gives `agent_loop.play` its episodes, their sessions bound to the service's
episodes; a record that does not fit is dropped and the prompt played from the start (counted in the
log). The record is deleted once the group is published (`published`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from sparkrl.proto import ChatMessage, Completion, decode_message, encode_message, group_id_for
from sparkrl.proto.partial import EpisodePiece, HeldEpisode, PartialEpisodes
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings.rollout import AgentSettings, PartialSettings
from sparkrl.services.rollout.agent_loop import EpisodeRun, Resumed
from sparkrl.services.rollout.batch import PromptBatch
from sparkrl.services.rollout.episode import Episode
from sparkrl.services.rollout.remote_env import RemoteSession

log = logging.getLogger("sparkrl.rollout")


def episodes_key(group_id: str) -> str:
    return f"episodes:{group_id}"


@dataclass
class EpisodeHandover:
    """A worker's side of episodes handed over: `take` those saved for the prompts it pulls, `hand_over`
    what it stops with, forget the records of groups it `published`."""

    bus: RedisBus
    partial: PartialSettings
    agent: AgentSettings
    worker_id: str

    @property
    def enabled(self) -> bool:
        return self.partial.enabled and self.agent.url is not None and self.agent.environment is not None

    def take(self, batch: PromptBatch, n: int, http: httpx.Client) -> tuple[Resumed, set[str]]:
        """The saved episodes of `batch`'s prompts that fit (by prompt index), and every group id that
        had a record (deleted once its group is published)."""
        resumed, found = Resumed(), set[str]()
        if not self.enabled:
            return resumed, found
        group_ids = [group_id_for(p.prompt_id) for p in batch.prompts]
        raws = self.bus.get_values([episodes_key(g) for g in group_ids])
        for index, (group_id, raw) in enumerate(zip(group_ids, raws, strict=True)):
            if raw is None:
                continue
            found.add(group_id)
            why, record = self._misfit(raw, list(batch.token_ids[index]), n)
            if record is None:
                log.info("episodes of %s not continued (%s): played from the prompt", group_id, why)
                continue
            assert self.agent.url is not None and self.agent.environment is not None  # enabled
            resumed.runs[index] = [
                resumed_run(
                    held,
                    list(record.context_ids),
                    bound(http, self.agent, held.episode_id),
                    record.tools,
                )
                for held in record.episodes
            ]
            resumed.tools = record.tools
            log.info("playing on %d episodes of %s from %s", len(record.episodes), group_id, record.producer)
        return resumed, found

    def _misfit(self, raw: str, prompt_ids: list[int], n: int) -> tuple[str, PartialEpisodes | None]:
        try:
            record = decode_message(raw, PartialEpisodes)
        except Exception as exc:  # a record of another build
            return f"unreadable: {exc}", None
        if (record.environment, record.url) != (self.agent.environment, self.agent.url):
            return f"played with {record.environment} at {record.url}", None
        if len(record.episodes) != n:
            return f"{len(record.episodes)} episodes, this worker plays {n}", None
        if record.prompt_token_ids.tolist() != prompt_ids:
            return "the prompt tokenizes differently here", None
        return "", record

    def hand_over(self, batch: PromptBatch, episodes: list[list[EpisodeRun]]) -> None:
        """Save each group's episodes as far as they got, then release the prompts."""
        assert self.agent.url is not None and self.agent.environment is not None  # enabled
        records = {}
        for prompt, pulled, runs in zip(batch.prompts, batch.token_ids, episodes, strict=True):
            if not runs:
                continue
            record = PartialEpisodes(
                group_id=group_id_for(prompt.prompt_id),
                prompt_token_ids=pulled,
                context_ids=runs[0].episode.prompt_ids,
                environment=self.agent.environment,
                url=self.agent.url,
                tools=runs[0].tools,
                episodes=[held_episode(run) for run in runs],
                producer=self.worker_id,
                saved_at=time.time(),
            )
            records[episodes_key(record.group_id)] = encode_message(record).decode()
        if records:  # saved before released: a prompt taken is never without its record
            self.bus.set_values(records, ttl_s=self.partial.ttl_s)
        self.bus.release("prompts", self.worker_id, [e.entry_id for e in batch.entries])
        running = sum(run.status == "running" for runs in episodes for run in runs)
        log.info("handed %d groups of episodes over (%d episodes running; %d prompts released)",
                 len(records), running, len(batch.prompts))  # fmt: skip

    def published(self, group_ids: set[str]) -> None:
        if group_ids:
            self.bus.delete_values([episodes_key(g) for g in sorted(group_ids)])


def bound(http: httpx.Client, agent: AgentSettings, episode_id: str) -> RemoteSession:
    """A session of the service's episode `episode_id`, already started."""
    assert agent.url is not None and agent.environment is not None
    session = RemoteSession(http, agent.url, agent.environment)
    session.episode_id = episode_id
    return session


def held_episode(run: EpisodeRun) -> HeldEpisode:
    """An episode in flight as the wire holds it."""
    assert isinstance(run.session, RemoteSession) and run.session.episode_id is not None
    return HeldEpisode(
        episode_id=run.session.episode_id,
        samples=[[_piece(p) for p in sample] for sample in run.episode.samples],
        turns=run.episode.turns,
        messages=[ChatMessage.model_validate(m) for m in run.messages],
        opening=run.opening,
        status=run.status,
        answer=run.answer,
        tool_calls=dict(run.tool_calls),
        environment_seconds=list(run.environment_seconds),
    )


def resumed_run(
    held: HeldEpisode, prompt_ids: list[int], session: RemoteSession, tools: list[dict[str, Any]]
) -> EpisodeRun:
    """The episode `held` describes, bound to its environment's `session`, ready to play on."""
    samples = [
        [p.model if p.model is not None else list(p.environment or []) for p in s] for s in held.samples
    ]
    episode = Episode(prompt_ids, pieces=samples[-1], turns=held.turns, split_off=samples[:-1])
    run = EpisodeRun(episode, [m.model_dump() for m in held.messages], session, status=held.status)
    run.answer, run.opening, run.tools = held.answer, held.opening, tools
    run.tool_calls.update(held.tool_calls)
    run.environment_seconds = list(held.environment_seconds)
    return run


def _piece(piece: Completion | list[int]) -> EpisodePiece:
    if isinstance(piece, Completion):
        return EpisodePiece(model=piece)
    return EpisodePiece(environment=[int(t) for t in piece])
