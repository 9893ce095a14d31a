"""A worker's batch as multi-turn episodes (`rollout.agent`, docs/agents.md): the prompts' groups played
with the environment (agent_loop.play), counted, and made into the wire's completions — or, when the worker
stops between two turns with the episodes in an environment service, handed over (episode_handover.py).

A prompt the environment refuses at its start is dead-lettered with the reason; an environment service
that fails leaves the batch unacknowledged, to be reclaimed; an engine that fails raises (the worker stops,
and its supervisor restarts it: episodes have no per-prompt diagnosis yet). With `weight_updates: in_flight`
a newer version is taken between turns.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import httpx

from sparkrl.proto import Completion
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import RolloutSettings
from sparkrl.services.rollout.agent_loop import EpisodeRun, play
from sparkrl.services.rollout.batch import PromptBatch
from sparkrl.services.rollout.engine import Engine
from sparkrl.services.rollout.episode_handover import EpisodeHandover
from sparkrl.services.rollout.heartbeat import Heartbeat, WorkerState
from sparkrl.services.rollout.metrics import WorkerMetrics, tally
from sparkrl.services.rollout.remote_env import EnvironmentUnavailable, RemoteSession

log = logging.getLogger("sparkrl.rollout")

Made = tuple[PromptBatch, list[list[Completion]]]  # a batch (what is left of it) and its completions


@dataclass
class EpisodePlayer:
    """The worker's parts a batch of episodes needs; `found`: the group ids whose handed-over episodes
    this batch goes on with (their records are deleted once the groups are published)."""

    engine: Engine
    bus: RedisBus
    metrics: WorkerMetrics
    state: WorkerState
    heartbeat: Heartbeat
    stop: threading.Event
    handover: EpisodeHandover
    found: set[str] = field(default_factory=set)

    def play(
        self, batch: PromptBatch, cfg: RolloutSettings, sync: Callable[[], None]
    ) -> tuple[Made | None, list[list[EpisodeRun]] | None]:
        """The batch's groups as episodes, played to their ends: its completions (one list per prompt
        kept) and its episodes; (None, None) when nothing is left to publish (refused, handed over, the
        service down)."""
        sampling, agent = batch.sampling(cfg.sampling), cfg.agent
        try:
            with httpx.Client() as http:
                remote = (
                    None if agent.url is None else partial(RemoteSession, http, agent.url, agent.environment)
                )
                resumed, self.found = self.handover.take(batch, sampling.n, http)

                def between_turns() -> bool:
                    if cfg.weight_updates == "in_flight":
                        sync()  # a newer version samples the next turns
                    return self.handover.enabled and self.stop.is_set()  # stopped: hand the episodes over

                runs, refused = play(self.engine, batch.prompts, sampling, agent, cfg.prompt_format, remote,
                                     between_turns, resumed)  # fmt: skip
        except EnvironmentUnavailable as exc:  # not acked: the prompts come back after bus.claim_idle_ms
            log.error("the environment service failed, leaving %d prompts to be reclaimed: %s",
                      len(batch.prompts), exc)  # fmt: skip
            return None, None
        for index, why in refused.items():
            self.bus.dead_letter("prompts", batch.entries[index], f"the environment refused it: {why}")
        keep = [i for i in range(len(batch.prompts)) if i not in refused]
        if not keep:
            return None, None
        episodes = [runs[i] for i in keep]
        if any(run.status == "running" for group in episodes for run in group):
            handed = batch.subset(keep)
            entries = {e.entry_id for e in handed.entries}
            with self.heartbeat.touching:  # no beat may touch (keep) what is released now
                self.state.in_flight = [e for e in self.state.in_flight if e not in entries]
            self.handover.hand_over(handed, episodes)
            return None, None
        return self._made(batch.subset(keep), episodes), episodes

    def _made(self, played: PromptBatch, episodes: list[list[EpisodeRun]]) -> Made:
        runs = [run for group in episodes for run in group]
        for run in runs:
            self.metrics.observe_episode(run)
        self.state.episodes = tally(self.state.episodes, runs)
        tokenizer = self.engine.tokenizer
        completions = [[c for run in group for c in run.completions(tokenizer)] for group in episodes]
        # The prompt as the episodes saw it (with the tools' schemas), not as it was pulled: the learner
        # must score every token in the context it was sampled in.
        played.token_ids = [group[0].episode.prompt_ids for group in episodes]
        return played, completions

    def published(self, group_ids: list[str]) -> None:
        """The groups published: the handed-over records they went on with are deleted."""
        self.handover.published(self.found.intersection(group_ids))
