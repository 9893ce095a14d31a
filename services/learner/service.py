"""The learner as a service: `build` its parts from the settings, `step` its loop once, `close` it.

A plain process (`sparkrl learner`) and a Ray actor (`sparkrl up --ray`) drive the same three; neither
touches signals here: whoever runs the loop owns them and sets `stop` (the CLI takes them over only once
the engine is built, so a start stuck in DeepSpeed still ends at the first SIGTERM).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from sparkrl.proto import SyncEvent
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.control_channel import ControlReader
from sparkrl.services.common.metrics_server import MetricsServer
from sparkrl.services.common.modeling import load_model, load_tokenizer
from sparkrl.services.common.recovery import warn_if_not_persistent
from sparkrl.services.common.settings import LearnerSettings, SparkSettings
from sparkrl.services.common.telemetry import LEARNER, Telemetry
from sparkrl.services.common.weight_sync.files import WeightFileServer
from sparkrl.services.learner.checkpoint import (
    CheckpointError,
    drop_overrides,
    latest_checkpoint,
    load_checkpoint,
    nonfinite_tensors,
)
from sparkrl.services.learner.control import LearnerControl, hparams_in_force
from sparkrl.services.learner.data_end import steps_the_data_allows
from sparkrl.services.learner.follower import follow
from sparkrl.services.learner.guard import broken_start, final_checkpoint_failed
from sparkrl.services.learner.learner import Learner, Setup
from sparkrl.services.learner.ledger import Journal, Ledger
from sparkrl.services.learner.metrics import LearnerMetrics
from sparkrl.services.learner.publisher import SNAPSHOT_NAME, WeightPublisher
from sparkrl.services.learner.ranks import RankLost, Ranks, world
from sparkrl.services.learner.reference import frozen_copy
from sparkrl.services.learner.reporting import Reporter, RunLog, StatusSource, write_ended
from sparkrl.services.learner.startup import clear_stale_locks, watchdog
from sparkrl.services.learner.state import TrainState
from sparkrl.services.learner.tracking import Tracker
from sparkrl.services.learner.trainer import build_engine, init_distributed

log = logging.getLogger("sparkrl.learner")


def _device(lc: LearnerSettings) -> str:
    """The learner's device; on a GPU, each rank its own (LOCAL_RANK, as every launcher sets it)."""
    if lc.device == "cpu":
        return "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return f"cuda:{local_rank}"


def setup_engine(cfg: SparkSettings, resume: bool) -> Setup:
    """Model → DeepSpeed engine, restored from the latest checkpoint when resuming; (…, resumed)."""
    lc = cfg.learner
    torch.manual_seed(lc.seed)
    if lc.threads is not None:
        torch.set_num_threads(lc.threads)
    init_distributed(lc, cfg.sync.host)
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, lc.dtype, _device(lc), lc.attention)
    # The KL reference is the initial model (cfg.model), also when resuming: copied before the checkpoint,
    # and before DeepSpeed, whose ZeRO-3 would leave a copy of the engine's module only its partitions.
    reference = frozen_copy(model) if lc.kl.coef > 0 else None
    engine = build_engine(model, lc)
    checkpoint = latest_checkpoint(Path(cfg.run_dir)) if resume else None
    if resume and checkpoint is None:
        log.warning("--resume: no checkpoint under %s; starting fresh", cfg.run_dir)
    if checkpoint is None:
        return engine, tokenizer, TrainState(started_at=time.time()), False, reference
    return engine, tokenizer, load_checkpoint(engine, checkpoint), True, reference


def run_state(run_dir: Path) -> str | None:
    """What a resume would go on from in `run_dir` (its latest checkpoint, or journaled steps that no
    checkpoint holds yet), in words; None for a directory without a run."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None:
        return f"checkpoint {checkpoint}"
    steps = Journal(run_dir).steps()
    return f"{len(steps)} journaled steps, no checkpoint yet" if steps else None


@dataclass
class LearnerService:
    """What `build` made and `close` releases."""

    loop: Learner
    files: WeightFileServer
    server: MetricsServer
    bus: RedisBus


def build(
    cfg: SparkSettings,
    resume: bool,
    stop: threading.Event,
    engine_built: Callable[[], None] = lambda: None,
) -> LearnerService:
    """Engine (restored when resuming), bus, control, publisher, weight files, heartbeat and /metrics;
    the journal replayed when resuming and the current version announced — ready for `step`."""
    lc, run_dir = cfg.learner, Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_locks()
    guard = watchdog(lc.startup_timeout_s)
    # Weight files for workers that cannot see this disk; the model is hashed while the engine builds.
    snapshot = run_dir / "snapshots" / SNAPSHOT_NAME
    files = WeightFileServer(cfg.sync.host, cfg.sync.http_port, Path(cfg.model), snapshot, cfg.sync.secret)
    files.start()
    engine, tokenizer, state, resumed, reference = setup_engine(cfg, resume)
    ranks = Ranks.join()  # every rank forms the orders' group right after its engine (follower.py)
    guard.cancel()
    engine_built()
    if ranks is None and lc.ranks > 1:
        log.warning(
            "learner.ranks is %d but this learner was started alone: training as one rank (`sparkrl up` "
            "starts the ranks under torchrun; elsewhere run `torchrun --nproc-per-node=%d -m sparkrl.cli "
            "learner …`)",
            lc.ranks,
            lc.ranks,
        )
    elif ranks is not None:
        log.info("learner rank 0 of %d: reads the bus and orders the others", ranks.size)
    bus = RedisBus(cfg.bus)
    warn_if_not_persistent(bus)
    telemetry, metrics, run_log = Telemetry(bus), LearnerMetrics(), RunLog(run_dir)

    def on_sync(event: SyncEvent) -> None:
        telemetry.append(event)
        run_log.write_sync(event)
        metrics.observe_sync(event)

    publisher = WeightPublisher(telemetry, cfg.sync, run_dir / "snapshots", on_sync=on_sync, files=files)
    control = LearnerControl(
        ControlReader(bus, telemetry, LEARNER), lc, engine, state.hparam_overrides, metrics.observe_command
    )
    # The status's max_steps (the progress line's total): learner.max_steps, or where the data runs out.
    status = StatusSource(
        publisher, lc.max_steps, lambda now: steps_the_data_allows(bus, lc.prompts_per_step, now)
    )
    reporter = Reporter(telemetry, state, status)
    server = MetricsServer(
        lc.metrics, metrics.registry, lambda: {"status": "ok", "phase": reporter.report.phase}
    )
    loop = Learner(
        engine=engine,
        tokenizer=tokenizer,
        bus=bus,
        telemetry=telemetry,
        cfg=lc,
        sync=cfg.sync,
        run_dir=run_dir,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        state=state,
        publisher=publisher,
        control=control,
        reporter=reporter,
        metrics=metrics,
        run_log=run_log,
        stop=stop,
        ledger=Ledger(bus, run_dir, state.step, fresh=not resume),
        reference=reference,
        ranks=ranks,
        tracker=Tracker(lc.tracking, run_dir, cfg.model_dump(mode="json")) if lc.tracking.to else None,
    )
    publisher.start()
    reporter.update(hparams=hparams_in_force(engine, lc))
    reporter.start()
    server.start()
    log.info("learner up: loss %s, %s, step %d", lc.loss.name, cfg.model, state.step)
    service = LearnerService(loop, files, server, bus)
    try:
        replayed = loop.replay() if resume else 0
        loop.ledger.retire_lost_versions(state, run_dir / "snapshots")
        loop.collector.void_versions = state.void_versions
        loop.collector.progress = state  # the end reason counts what it trained
        files.wait_listed()  # the first announcement carries the model's digest
        weights = loop.full_weights()
        if names := nonfinite_tensors(weights):  # a checkpoint or model that was saved broken
            loop.guard.weights_broken = True
            loop.guard.stop = broken_start(names, state.step, str(latest_checkpoint(run_dir) or cfg.model))
            raise RuntimeError(loop.guard.stop)
        # A fresh run's version 0 is the model every worker loaded already; a resumed one must be sent.
        publisher.submit(state.policy_version, weights, broadcast=resumed or replayed > 0)
    except BaseException as exc:
        if loop.guard.stop is None:  # ended.json says why (a replay that failed, a signal, ...)
            loop.crashed = f"the learner failed to start: {type(exc).__name__}: {exc}"[:2000]
        close(service)
        raise
    return service


def step(service: LearnerService) -> bool:
    """One turn of the loop (the control boundary, then a step or a paused wait); False once it is over:
    max_steps, `stop`, or a stop command (answered by `close`), or a learner rank lost (`rank_lost`)."""
    try:
        return service.loop.turn()
    except RankLost:
        return False  # logged; `close` writes no checkpoint, `main` exits non-zero


def close(service: LearnerService) -> None:
    """The final checkpoint first (disk only, before anything that may wait on the network), then the
    stop command's answer, the last broadcast, the heartbeat and the listeners. `ended.json` says why
    the run ended; `loop.failed`, why it ends non-zero (`main` exits so)."""
    loop = service.loop
    state, command = loop.state, loop.stop_command
    keep_final = command is None or command.body.checkpoint  # type: ignore[union-attr]
    keep_final = keep_final and loop.rank_lost is None  # the ranks' partitions cannot all be written
    keep_final = keep_final and not loop.guard.weights_broken  # never checkpoint weights that are not finite
    causes = [why for why in (loop.rank_lost, loop.crashed, loop.guard.stop) if why]  # each ends non-zero
    final_failed: list[str] = []
    if keep_final and state.step > loop.ledger.saved_step:
        try:
            loop.checkpoint(None)
        except RankLost:
            log.warning("no final checkpoint: the learner's ranks cannot all write theirs (see above)")
        except Exception as exc:  # a disk full or gone (CheckpointError), or DeepSpeed's own error
            keep_final = False
            final_failed.append(final_checkpoint_failed(exc, state.step, loop.ledger.saved_step))
            log.error("%s", final_failed[0], exc_info=not isinstance(exc, CheckpointError))
    suspect, latest = loop.guard.suspect, latest_checkpoint(loop.run_dir)
    if suspect is not None and latest is not None:
        try:
            drop_overrides(latest, list(suspect.values))  # an older checkpoint may carry it
        except OSError as exc:
            log.warning("%s still carries %s: %s", latest, suspect.describe(), exc)
    loop.release_ranks()
    loop.reporter.update(phase="stopping")
    if command is not None:
        where = f"; checkpoint {loop.reporter.report.last_checkpoint}" if keep_final else ""
        loop.control.answer(command, "applied", f"stopped at step {state.step}{where}", state.step)
    loop.publisher.close()
    loop.failed = "; then ".join(causes + final_failed) or None
    normal = loop.ended or ("a stop command" if command is not None else "stopped (signal)")
    ended = loop.failed if causes else "; then ".join([normal, *final_failed])
    write_ended(loop.run_dir, ended, state.step, loop.collector.counts)
    loop.reporter.update(phase="stopped")
    loop.reporter.close()
    service.files.close()
    service.server.close()
    loop.run_log.close()
    if loop.tracker is not None:
        loop.tracker.close()
    service.bus.close()
    log.info("learner stopped at step %d (policy version %d): %s", state.step, state.policy_version, ended)


def main(
    cfg: SparkSettings,
    resume: bool = False,
    stop: threading.Event | None = None,
    engine_built: Callable[[], None] = lambda: None,
) -> None:
    """Build, step until over, close: train until max_steps, a stop command or `stop`. A data-parallel
    learner's other ranks follow rank 0's orders instead (follower.py)."""
    if world()[0] != 0:
        follow(cfg, resume)
        return
    service = build(cfg, resume, stop or threading.Event(), engine_built)
    try:
        running = True
        while running:
            running = step(service)
    except Exception as exc:  # ended.json must say so, not "stopped (signal)"
        service.loop.crashed = f"the learner failed: {type(exc).__name__}: {exc}"[:2000]
        raise
    finally:
        close(service)
    if service.loop.failed is not None:
        raise SystemExit(f"learner: {service.loop.failed}")
