"""The learner: one process, one loop — pull_batch → compute old policy → train_step → publish_weights.

Groups are acknowledged only after the step that used them; each trained group id is also recorded in
Redis before the ack, so a crash between the two never trains a group twice. Groups sampled more than
`max_staleness` versions ago are dropped (acknowledged, counted). Weights go out through a publisher
thread, so a slow or dead worker never stalls training.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from deepspeed import DeepSpeedEngine
from transformers import PreTrainedTokenizerBase

from sparkrl.proto import LearnerStatus, TrajectoryGroup, decode_group
from sparkrl.services.common.bus import Entry, RedisBus
from sparkrl.services.common.logs import stop_on_signals
from sparkrl.services.common.modeling import load_model, load_tokenizer
from sparkrl.services.common.settings import LearnerSettings, SparkSettings
from sparkrl.services.learner.batch import micro_batches, samples_from_groups
from sparkrl.services.learner.checkpoint import (
    TrainState,
    cpu_weights,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from sparkrl.services.learner.publisher import WeightPublisher, live_workers
from sparkrl.services.learner.trainer import build_engine, init_distributed, old_policy, train_step

log = logging.getLogger("sparkrl.learner")

CONSUMER = "learner"
TRAINED_PREFIX = "trained:"  # bus value per trained group id: the step that used it


@dataclass
class Batch:
    """The groups of one optimizer step and the stream entries to acknowledge after it."""

    groups: list[TrajectoryGroup]
    entries: list[Entry]
    dropped_stale: int
    staleness_mean: float


def pull_batch(bus: RedisBus, cfg: LearnerSettings, version: int, stop: threading.Event) -> Batch | None:
    """Read until `prompts_per_step` fresh, untrained groups are in hand (None if stopped first)."""
    groups: list[TrajectoryGroup] = []
    entries: list[Entry] = []
    seen: set[str] = set()
    dropped, staleness = 0, []
    while len(groups) < cfg.prompts_per_step:
        if stop.is_set():
            return None
        # Entries held across reads would otherwise be reclaimed (and re-delivered to us) when idle.
        bus.touch("trajectories", CONSUMER, [e.entry_id for e in entries])
        need = cfg.prompts_per_step - len(groups)
        for entry, group in bus.read_decoded("trajectories", CONSUMER, need, decode_group):
            lag = version - group.oldest_policy_version
            if group.group_id in seen:
                continue
            if bus.get_value(TRAINED_PREFIX + group.group_id) is not None or lag > cfg.max_staleness:
                dropped += lag > cfg.max_staleness
                bus.ack("trajectories", [entry.entry_id])
                continue
            seen.add(group.group_id)
            groups.append(group)
            entries.append(entry)
            staleness.append(lag)
    return Batch(groups, entries, dropped, sum(staleness) / len(staleness))


def compute_update(
    engine: DeepSpeedEngine, batch: Batch, cfg: LearnerSettings, pad_id: int
) -> dict[str, float]:
    """old policy for every micro-batch (before any update), then one optimizer step."""
    device = engine.device
    batches = [
        mb.to(device)
        for mb in micro_batches(samples_from_groups(batch.groups), cfg.micro_batch_tokens, pad_id)
    ]
    engine.eval()
    olds = [old_policy(engine.module, mb, cfg) for mb in batches]
    engine.train()
    return train_step(engine, batches, olds, cfg)


def finish_step(bus: RedisBus, batch: Batch, state: TrainState) -> None:
    """Record the trained ids, then acknowledge (and delete) their entries."""
    for group in batch.groups:
        bus.set_value(TRAINED_PREFIX + group.group_id, str(state.step), ttl_s=bus.settings.dedup_ttl_s)
    bus.ack("trajectories", [e.entry_id for e in batch.entries])
    state.groups_trained += len(batch.groups)
    state.groups_dropped_stale += batch.dropped_stale
    state.trained_group_ids = [g.group_id for g in batch.groups]


def step_metrics(
    batch: Batch,
    stats: dict[str, float],
    state: TrainState,
    publisher: WeightPublisher,
    seconds: float,
    bus: RedisBus,
) -> dict[str, object]:
    rewards = [r for g in batch.groups for r in g.rewards]
    sync = publisher.last_sync
    return {
        "step": state.step,
        "policy_version": state.policy_version,
        "reward_mean": sum(rewards) / max(len(rewards), 1),
        "entropy": stats.get("entropy", float("nan")),
        "loss": stats.get("loss", float("nan")),
        "reg_tokens": stats.get("reg_tokens", 0.0),
        "staleness_mean": batch.staleness_mean,
        "dropped_stale": batch.dropped_stale,
        "sync_seconds": sync.seconds if sync else None,
        "synced_version": sync.version if sync else None,
        "worker_versions": {w: s.policy_version for w, s in live_workers(bus).items()},
        "groups": len(batch.groups),
        "tokens": stats.get("tokens", 0.0),
        "clip_frac": stats.get("clip_frac", 0.0),
        "ratio_kl": stats.get("ratio_kl", 0.0),
        "grad_norm": stats.get("grad_norm", float("nan")),
        "proxy_inexact": stats.get("proxy_inexact", 0.0),
        "step_seconds": seconds,
        "time": time.time(),
    }


def report_status(
    bus: RedisBus, state: TrainState, publisher: WeightPublisher, phase: str, loss: float | None
) -> None:
    sync = publisher.last_sync
    status = LearnerStatus(
        step=state.step,
        policy_version=state.policy_version,
        state=phase,
        groups_trained=state.groups_trained,
        last_loss=loss,
        last_sync_seconds=sync.seconds if sync else None,
        group_epoch=publisher.epoch,
        members=list(publisher.members),
        heartbeat_at=time.time(),
    )
    bus.put_status("learner", "learner", status.model_dump_json(), ttl_s=60.0)


def wait_for_fleet(bus: RedisBus, members: tuple[str, ...], version: int, timeout_s: float) -> bool:
    """Until every member's heartbeat reports `version` (workers beat right after loading weights, but
    after acknowledging them, so the status can trail the broadcast by a moment); False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = {w: s.policy_version for w, s in live_workers(bus).items()}
        if all(held.get(member) == version for member in members):
            return True
        time.sleep(0.05)
    return False


class RunLog:
    """`metrics.jsonl` (one row per step) and `trained_groups.jsonl` (the audit trail of "each group is
    trained once": the group ids of every step), both appended and flushed per step."""

    def __init__(self, run_dir: Path) -> None:
        self.metrics = (run_dir / "metrics.jsonl").open("a")
        self.trained = (run_dir / "trained_groups.jsonl").open("a")

    def write(self, row: dict[str, object], state: TrainState) -> None:
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        self.trained.write(json.dumps({"step": state.step, "group_ids": state.trained_group_ids}) + "\n")
        self.trained.flush()
        log.info("step %d: reward %.3f loss %.4f", state.step, row["reward_mean"], row["loss"])

    def close(self) -> None:
        self.metrics.close()
        self.trained.close()


Setup = tuple[DeepSpeedEngine, PreTrainedTokenizerBase, TrainState, bool]


def setup_engine(cfg: SparkSettings, resume: bool) -> Setup:
    """Model → DeepSpeed engine, restored from the latest checkpoint when resuming; (…, resumed)."""
    lc = cfg.learner
    torch.manual_seed(lc.seed)
    if lc.threads is not None:
        torch.set_num_threads(lc.threads)
    init_distributed(lc)
    tokenizer = load_tokenizer(cfg.model)
    engine = build_engine(load_model(cfg.model, lc.dtype, "cpu" if lc.device == "cpu" else "cuda"), lc)
    checkpoint = latest_checkpoint(Path(cfg.run_dir)) if resume else None
    if resume and checkpoint is None:
        log.warning("--resume: no checkpoint under %s; starting fresh", cfg.run_dir)
    if checkpoint is None:
        return engine, tokenizer, TrainState(started_at=time.time()), False
    return engine, tokenizer, load_checkpoint(engine, checkpoint), True


def main(cfg: SparkSettings, resume: bool = False) -> None:
    """Build engine, bus and publisher; train until max_steps or a signal; checkpoint on the way out."""
    lc, run_dir = cfg.learner, Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    stop = stop_on_signals(log, "the current step")
    engine, tokenizer, state, resumed = setup_engine(cfg, resume)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    bus = RedisBus(cfg.bus)
    publisher = WeightPublisher(bus, lc.sync, run_dir / "snapshots")
    publisher.start()
    # A fresh run's version 0 is the model every worker loaded already; a resumed one must be sent.
    publisher.submit(state.policy_version, cpu_weights(engine), broadcast=resumed)
    run_log, saved_step = RunLog(run_dir), state.step
    log.info("learner up: loss %s, %s, step %d", lc.loss.name, cfg.model, state.step)
    try:
        while not stop.is_set() and (lc.max_steps is None or state.step < lc.max_steps):
            report_status(bus, state, publisher, "training", None)
            batch = pull_batch(bus, lc, state.policy_version, stop)
            if batch is None:
                break
            started = time.monotonic()
            stats = compute_update(engine, batch, lc, pad_id)
            state.step += 1
            state.policy_version += 1
            finish_step(bus, batch, state)
            publisher.submit(state.policy_version, cpu_weights(engine))
            if state.step == lc.max_steps:
                # The last row should show where the fleet ends up, not where it was mid-broadcast.
                publisher.flush(lc.sync.timeout_s)
                wait_for_fleet(bus, publisher.members, state.policy_version, timeout_s=5.0)
            seconds = time.monotonic() - started
            run_log.write(step_metrics(batch, stats, state, publisher, seconds, bus), state)
            if state.step % lc.checkpoint_every == 0:
                save_checkpoint(engine, tokenizer, run_dir, state, lc.keep_checkpoints)
                saved_step = state.step
    finally:
        report_status(bus, state, publisher, "checkpointing", None)
        if state.step > saved_step:
            save_checkpoint(engine, tokenizer, run_dir, state, lc.keep_checkpoints)
        publisher.close()
        report_status(bus, state, publisher, "stopped", None)
        run_log.close()
        bus.close()
        log.info("learner stopped at step %d (policy version %d)", state.step, state.policy_version)
