"""The rollout worker: one process, one loop — pull prompts → generate groups → score → publish → ack.

A prompt is acknowledged only after its group is published (idempotently, by group id), so a worker that
dies at any point loses nothing: its pending prompts are reclaimed by another worker after
`bus.claim_idle_ms`, and a replayed group id is dropped by the bus. SIGTERM/SIGINT finish the batch in
hand and exit; SIGKILL leaves the batch to be reclaimed.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field

from sparkrl.proto import (
    Prompt,
    RewardItem,
    RewardResult,
    SamplingParams,
    TrajectoryGroup,
    WeightAnnouncement,
    WorkerStatus,
    decode_message,
    encode_group,
    group_id_for,
)
from sparkrl.services.common.bus import BusBackpressureTimeout, Entry, RedisBus
from sparkrl.services.common.logs import stop_on_signals
from sparkrl.services.common.modeling import apply_chat_template_if_any
from sparkrl.services.common.reward_client import RewardClient, RewardServiceError
from sparkrl.services.common.settings import RolloutSettings, SparkSettings
from sparkrl.services.common.weight_sync import NotAMember, SyncFailed, WeightReceiver
from sparkrl.services.rollout.engine import Engine, make_engine

log = logging.getLogger("sparkrl.rollout")

STATUS_KIND = "worker"
ANNOUNCEMENT_KEY = "weights"  # where the learner announces each new policy (WeightAnnouncement JSON)


@dataclass
class WorkerState:
    """What the heartbeat reports; written by the loop, read by the heartbeat thread."""

    worker_id: str
    engine: str
    state: str = "starting"
    policy_version: int | None = None
    weights_checksum: str | None = None
    tokens_per_s: float = 0.0
    groups_published: int = 0
    in_flight: list[str] = field(default_factory=list)  # prompt-stream entry ids being worked on
    last_sync_seconds: float | None = None


@dataclass
class PromptBatch:
    """Prompts taken from the stream together, with their entries (for ack) and token ids."""

    entries: list[Entry]
    prompts: list[Prompt]
    token_ids: list[list[int]]


def pull_prompts(bus: RedisBus, engine: Engine, worker_id: str, count: int) -> PromptBatch | None:
    """Up to `count` prompts; malformed ones go to the dead-letter stream with the reason."""
    decoded = bus.read_decoded("prompts", worker_id, count, lambda raw: decode_message(raw, Prompt))
    if not decoded:
        return None
    entries, prompts = [entry for entry, _ in decoded], [prompt for _, prompt in decoded]
    token_ids = [apply_chat_template_if_any(engine.tokenizer, p.messages or p.text) for p in prompts]
    return PromptBatch(entries, prompts, token_ids)


def generate_groups(
    engine: Engine, batch: PromptBatch, cfg: RolloutSettings, worker_id: str
) -> list[TrajectoryGroup]:
    """Sample n completions per prompt; rewards are filled in by `score_groups`."""
    created_at = time.time()
    completions = engine.generate(batch.token_ids, cfg.sampling)
    sampling = SamplingParams(
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        max_new_tokens=cfg.sampling.max_new_tokens,
    )
    groups = []
    for prompt, prompt_ids, group in zip(batch.prompts, batch.token_ids, completions, strict=True):
        placeholder = RewardResult(score=0.0, status="no_answer", detail="not scored yet", elapsed_s=0.0)
        groups.append(
            TrajectoryGroup(
                group_id=group_id_for(prompt.prompt_id),
                prompt=prompt,
                prompt_token_ids=prompt_ids,
                completions=group,
                rewards=[0.0] * len(group),
                reward_details=[placeholder] * len(group),
                task=prompt.task,
                producer=worker_id,
                vocab_size=engine.vocab_size,
                topk=cfg.sampling.topk_logprobs,
                sampling=sampling,
                created_at=created_at,
                scored_at=created_at,
                published_at=created_at,
            )
        )
    return groups


def score_groups(reward: RewardClient, groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """One batched HTTP call for every completion of every group; retried inside the client."""
    items = [
        RewardItem(task=g.task, completion=c.text, answer=g.prompt.answer, task_data=g.prompt.task_data)
        for g in groups
        for c in g.completions
    ]
    results = iter(reward.score(items))
    scored_at = time.time()
    scored = []
    for group in groups:
        details = [next(results) for _ in group.completions]
        update = {"rewards": [d.score for d in details], "reward_details": details, "scored_at": scored_at}
        scored.append(group.model_copy(update=update))
    return scored


def publish_groups(
    bus: RedisBus, groups: list[TrajectoryGroup], entries: list[Entry], stop: threading.Event
) -> int:
    """Publish each group, then ack its prompt; returns the number new (a replay is dropped, yet acked).

    While the trajectory stream is full (the learner sets the pace) this waits, in short slices so that a
    stop request is honoured; groups left unpublished keep their prompts unacked, to be reclaimed.
    """
    new = 0
    for group, entry in zip(groups, entries, strict=True):
        group = group.model_copy(update={"published_at": time.time()})
        payload, deadline = encode_group(group), time.monotonic() + bus.settings.publish_timeout_s
        while True:
            try:
                new += bus.publish_group(group.group_id, payload, timeout_s=1.0)
                break
            except BusBackpressureTimeout:
                if stop.is_set() or time.monotonic() > deadline:
                    log.warning(
                        "trajectory stream full; leaving %d prompts to be reclaimed", len(groups) - new
                    )
                    return new
        bus.ack("prompts", [entry.entry_id])
    return new


class Heartbeat(threading.Thread):
    """Reports `WorkerState` every period and keeps in-flight prompts from being reclaimed mid-generation
    (generation can outlast `bus.claim_idle_ms`); a thread because the loop blocks inside generate()."""

    def __init__(self, bus: RedisBus, state: WorkerState, period_s: float) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.bus, self.state, self.period_s = bus, state, period_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.period_s):
            self.beat()

    def beat(self) -> None:
        s = self.state
        try:
            self.bus.touch("prompts", s.worker_id, list(s.in_flight))
            lag = self.bus.pending_info("prompts").lag
            status = WorkerStatus(
                worker_id=s.worker_id,
                engine=s.engine,
                state=s.state,
                policy_version=s.policy_version,
                weights_checksum=s.weights_checksum,
                tokens_per_s=s.tokens_per_s,
                groups_published=s.groups_published,
                prompts_in_flight=len(s.in_flight),
                queue_lag=lag,
                last_sync_seconds=s.last_sync_seconds,
                heartbeat_at=time.time(),
            )
            self.bus.put_status(STATUS_KIND, s.worker_id, status.model_dump_json(), ttl_s=3 * self.period_s)
        except Exception:  # a missed beat must never kill the worker; the next one retries
            log.exception("heartbeat failed")


def latest_announcement(bus: RedisBus) -> WeightAnnouncement | None:
    raw = bus.get_value(ANNOUNCEMENT_KEY)
    if raw is None:
        return None
    try:
        return WeightAnnouncement.model_validate_json(raw)
    except ValueError:
        log.exception("ignoring a malformed weight announcement")
        return None


def load_snapshot(engine: Engine, path: str) -> int | None:
    """A late joiner's catch-up: the learner's latest snapshot, if newer than what we hold."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as snapshot:
        version = int((snapshot.metadata() or {}).get("version", -1))
        if version == engine.policy_version:
            return None
        tensors = {name: snapshot.get_tensor(name) for name in snapshot.keys()}
    engine.load_weights(tensors.items(), version)
    return version


def sync_weights(bus: RedisBus, receiver: WeightReceiver, engine: Engine, state: WorkerState) -> bool:
    """Between generation steps: take the announced version if we are in its group, else catch up from the
    snapshot; True when the weights changed. A failed sync only costs this version: the learner re-forms
    the group for the next one."""
    announcement = latest_announcement(bus)
    # `!=`, not `>`: a learner resumed from an older checkpoint is followed back too.
    if announcement is None or announcement.version == engine.policy_version:
        return False
    start = time.monotonic()
    state.state = "syncing"
    try:
        if state.worker_id in announcement.members:
            tensors = receiver.receive(announcement)
            engine.load_weights(tensors.items(), announcement.version)
        elif not (announcement.snapshot_path and load_snapshot(engine, announcement.snapshot_path)):
            return
    except NotAMember:
        return
    except (SyncFailed, OSError) as exc:
        log.warning("weight sync of version %d failed: %s", announcement.version, exc)
        return
    finally:
        state.state = "generating"
    state.policy_version = engine.policy_version
    state.weights_checksum = engine.weights_checksum()  # of what the engine holds, not what was sent
    state.last_sync_seconds = time.monotonic() - start
    log.info("now on policy version %d (%.2fs)", engine.policy_version, state.last_sync_seconds)
    return True


def run_step(
    bus: RedisBus,
    engine: Engine,
    reward: RewardClient,
    cfg: RolloutSettings,
    state: WorkerState,
    stop: threading.Event,
) -> bool:
    """One pass of the loop; False when there was nothing to do."""
    batch = pull_prompts(bus, engine, state.worker_id, cfg.prompts_per_batch)
    if batch is None:
        return False
    state.in_flight = [e.entry_id for e in batch.entries]
    state.state = "generating"
    start = time.monotonic()
    try:
        groups = generate_groups(engine, batch, cfg, state.worker_id)
    except Exception as exc:  # a prompt the engine cannot take (too long, bad template) must not kill us
        log.exception("generation failed; dead-lettering %d prompts", len(batch.entries))
        for entry in batch.entries:
            bus.dead_letter("prompts", entry, f"generation failed: {type(exc).__name__}: {exc}")
        state.in_flight = []
        return True
    tokens = sum(c.num_tokens for g in groups for c in g.completions)
    state.tokens_per_s = tokens / max(time.monotonic() - start, 1e-9)
    try:
        groups = score_groups(reward, groups)
    except RewardServiceError as exc:
        # Not acked: the prompts come back (to us or another worker) after bus.claim_idle_ms.
        log.error("scoring failed, leaving %d prompts to be retried: %s", len(groups), exc)
        state.in_flight = []
        return True
    state.groups_published += publish_groups(bus, groups, batch.entries, stop)
    state.in_flight = []
    return True


def main(cfg: SparkSettings) -> None:
    """Build the engine, bus and reward client from the settings, then loop until signalled."""
    worker_id = cfg.rollout.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    stop = stop_on_signals(log, "the batch in hand")
    engine = make_engine(cfg.model, cfg.rollout.engine)
    bus = RedisBus(cfg.bus)
    reward = RewardClient(cfg.reward.url, cfg.rollout.reward_timeout_s, cfg.rollout.reward_retries)
    state = WorkerState(worker_id, cfg.rollout.engine.kind, policy_version=engine.policy_version)
    receiver = WeightReceiver(
        worker_id, backend=cfg.learner.sync.backend, timeout_s=cfg.learner.sync.timeout_s
    )
    heartbeat = Heartbeat(bus, state, cfg.rollout.heartbeat_s)
    heartbeat.beat()
    heartbeat.start()
    log.info("worker %s up: model %s, engine %s", worker_id, cfg.model, cfg.rollout.engine.kind)
    try:
        while not stop.is_set():
            if sync_weights(bus, receiver, engine, state):
                heartbeat.beat()  # the learner and the monitor see the new version now, not a period later
            run_step(bus, engine, reward, cfg.rollout, state, stop)
    finally:
        state.state = "stopping"
        heartbeat.stopped.set()
        heartbeat.beat()
        receiver.close()
        engine.close()
        reward.close()
        bus.close()
        log.info("worker %s stopped after %d groups", worker_id, state.groups_published)
