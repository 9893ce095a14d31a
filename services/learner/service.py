"""The learner as a service: `build` its parts from its role's settings (`LearnerConfig`), `run` the
loop, `close` it (`main`: all three). A data-parallel learner's other ranks `follow` rank 0's orders
instead (ranks.py).

A plain process (`sparkrl learner`) and a Ray actor (`sparkrl up --ray`) drive the same `main`; neither
touches signals here: whoever runs the loop owns them and sets `stop` (the CLI takes them over only once
the engine is built, so a start stuck in DeepSpeed still ends at the first SIGTERM).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sparkrl.proto import SyncEvent
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.control_channel import ControlReader
from sparkrl.services.common.metrics_server import MetricsServer
from sparkrl.services.common.ownership import Fence, Lease, run_id_of
from sparkrl.services.common.recovery import warn_if_not_persistent
from sparkrl.services.common.settings.roles import LearnerConfig
from sparkrl.services.common.start_clock import StartClock
from sparkrl.services.common.telemetry import LEARNER, Telemetry
from sparkrl.services.common.weight_sync.files import WeightFileServer

# Before any module below imports DeepSpeed: the learner's process imports it without mlflow (~1 s).
from sparkrl.services.learner import _deepspeed  # noqa: F401  (sorted before them: keep it first)
from sparkrl.services.learner.checkpoint import latest_checkpoint
from sparkrl.services.learner.collect import BatchCollector
from sparkrl.services.learner.control import LearnerControl, hparams_in_force, resumed
from sparkrl.services.learner.data_end import steps_the_data_allows
from sparkrl.services.learner.fleet import Fleet
from sparkrl.services.learner.guard import StepGuard, Streak
from sparkrl.services.learner.heartbeat import Heartbeat, StatusSource
from sparkrl.services.learner.learner import Ending, Learner
from sparkrl.services.learner.ledger import FilteredLog, Journal, Ledger
from sparkrl.services.learner.metrics import LearnerMetrics
from sparkrl.services.learner.publisher import SNAPSHOT_NAME, WeightPublisher
from sparkrl.services.learner.ranks import follow, trainer_for, world
from sparkrl.services.learner.reporting import ENDED_FILE, Reports, RunLog, write_ended
from sparkrl.services.learner.startup import clear_stale_locks, watchdog
from sparkrl.services.learner.tracking import Tracker, tracked_config
from sparkrl.services.learner.trainer import Loaded, Trainer, load
from sparkrl.services.learner.validate import ModelLimits

log = logging.getLogger("sparkrl.learner")


def run_state(run_dir: Path) -> str | None:
    """What a resume would go on from in `run_dir` (its latest checkpoint, or journaled steps that no
    checkpoint holds yet), in words; None for a directory without a run."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None:
        return f"checkpoint {checkpoint}"
    steps = Journal(run_dir).steps()
    return f"{len(steps)} journaled steps, no checkpoint yet" if steps else None


def assemble(
    cfg: LearnerConfig,
    loaded: Loaded,
    trainer: Trainer,
    bus: RedisBus,
    stop: threading.Event,
    files: WeightFileServer | None = None,
    fresh: bool = True,
) -> Learner:
    """The loop and its parts over `trainer` and `bus`, nothing started (`build` starts the publisher's
    and the heartbeat's threads). `files`: the weight-file server the announcements name. `fresh`: a new
    run (an earlier run's journal in the directory is deleted, not replayed)."""
    lc, run_dir, state = cfg.learner, Path(cfg.run_dir), loaded.state
    telemetry, metrics, run_log = Telemetry(bus), LearnerMetrics(), RunLog(run_dir)

    def on_sync(event: SyncEvent) -> None:  # on the publisher's thread
        telemetry.append(event)
        run_log.write_sync(event)
        metrics.observe_sync(event)

    publisher = WeightPublisher(telemetry, cfg.sync, run_dir / "snapshots", on_sync=on_sync, files=files)
    # The status's max_steps (the progress line's total): learner.max_steps, or where the data runs out;
    # its max_staleness: the one in force, from the hyperparameters the loop reports each turn.
    status = StatusSource(publisher, lc, lambda now: steps_the_data_allows(bus, lc.prompts_per_step, now))
    tracker = (
        Tracker(lc.tracking, run_dir, tracked_config(cfg.model_dump(mode="json"), run_dir))
        if lc.tracking.to
        else None
    )
    reports = Reports(
        telemetry, Heartbeat(telemetry, state, status), metrics, run_log, loaded.tokenizer, tracker
    )
    reader = ControlReader(bus, telemetry, LEARNER)
    live, carried = resumed(lc, state.hparam_overrides)  # the live changes a resumed checkpoint carries
    control = LearnerControl(reader, carried, metrics.observe_command)
    limits = ModelLimits.of(loaded.engine.module, lc)
    filtered_log = FilteredLog(bus, run_dir)  # learner.filter_groups' record (dynamic_sampling.py)
    collector = BatchCollector(bus, lc, limits, progress=state, filtered_log=filtered_log)
    guard = StepGuard(trainer, bus, collector, control, metrics, state, Streak(lc.max_nonfinite_steps))
    ledger = Ledger(bus, run_dir, state.step, fresh)
    fleet = Fleet(telemetry, publisher, cfg.sync.timeout_s)
    return Learner(live, run_dir, state, trainer, ledger, collector, fleet, control, guard, reports, stop)


@dataclass
class LearnerService:
    """What `build` made: the loop, and the listeners it runs beside (closed with it)."""

    loop: Learner
    files: WeightFileServer
    server: MetricsServer
    bus: RedisBus
    lease: Lease  # the namespace's: released at the end
    final_scrape_s: float  # learner.metrics.final_scrape_s


def build(
    cfg: LearnerConfig,
    resume: bool,
    stop: threading.Event,
    engine_built: Callable[[], None] = lambda: None,
) -> LearnerService:
    """Engine (restored when resuming), bus, the loop's parts, weight files, heartbeat and /metrics;
    the journal replayed when resuming and the current version announced — ready to `run`."""
    clock = StartClock()
    clock.mark("imports")
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_locks()
    # The bus first: the learner claims its namespace (and fences the run directory) before it loads a
    # checkpoint, since a load may set one aside. Given the stop, it gives up on Redis within seconds once
    # told to stop (an orphan of a killed launcher, whose Redis died with it, exits instead of retrying).
    bus = RedisBus(cfg.bus, stop)
    lease = Lease.claim(bus, cfg.bus.run_id or run_id_of(run_dir, fresh=not resume), run_dir, stop)
    lease.start()
    guard = watchdog(cfg.learner.startup_timeout_s)
    # Weight files for workers that cannot see this disk; the model is hashed while the engine builds.
    snapshot = run_dir / "snapshots" / SNAPSHOT_NAME
    files = WeightFileServer(cfg.sync.host, cfg.sync.http_port, Path(cfg.model), snapshot, cfg.sync.secret)
    files.start()
    loaded = load(cfg, resume, clock)
    trainer = trainer_for(cfg, loaded)  # every rank joins the orders' group right after its engine
    guard.cancel()
    engine_built()
    warn_if_not_persistent(bus)
    loop = assemble(cfg, loaded, trainer, bus, stop, files, fresh=not resume)
    loop.fence = Fence(run_dir, lease.owner)
    heartbeat = loop.reports.heartbeat
    server = MetricsServer(
        cfg.learner.metrics,
        loop.reports.metrics.registry,
        lambda: {"status": "ok", "phase": heartbeat.report.phase, "redis": bus.reconnect.trouble or "ok"},
    )
    loop.fleet.publisher.start()
    heartbeat.update(hparams=hparams_in_force(trainer.lr(), loop.live))
    heartbeat.start()
    server.start()
    log.info("learner up: loss %s, %s, step %d", cfg.learner.loss.name, cfg.model, loaded.state.step)
    service = LearnerService(loop, files, server, bus, lease, cfg.learner.metrics.final_scrape_s)
    try:
        files.wait_listed()  # every announcement, a replay's included, carries the model's digest
        loop.ledger.settle_checkpointed()
        replayed = loop.replay() if resume else 0
        loop.ledger.retire_lost_versions(loop.state, run_dir / "snapshots")
        # A fresh run's version 0 is the model every worker loaded already; a resumed one must be sent (the
        # version a replay ended on was sent already: the publisher sends a version once).
        loop.publish_first(loaded.resumed or replayed > 0, str(latest_checkpoint(run_dir) or cfg.model))
        clock.mark("ready")
        heartbeat.update(startup_s=clock.phases)
        log.info(
            "started in %.1f s: %s", clock.total, ", ".join(f"{k} {v:.1f} s" for k, v in clock.phases.items())
        )
    except BaseException as exc:  # ended.json says why (a replay that failed, a signal, ...)
        why = f"the learner failed to start: {type(exc).__name__}: {exc}"[:2000]
        close(service, Ending(crashed=None if loop.guard.stop else why))  # a guard's reason is its own
        raise
    return service


def close(service: LearnerService, ending: Ending) -> str | None:
    """The loop's close (final checkpoint, stop answer, last broadcast, `ended.json`), then the listeners
    and the bus. Returns why the run ends non-zero (None: it does not)."""
    failed = service.loop.close(ending)
    service.server.await_last_scrape(service.final_scrape_s)  # the run's end on the dashboard
    service.files.close()
    service.server.close()
    service.lease.release()
    service.bus.close()
    return failed


def main(
    cfg: LearnerConfig,
    resume: bool = False,
    stop: threading.Event | None = None,
    engine_built: Callable[[], None] = lambda: None,
) -> None:
    """Build, run until over, close: train until max_steps, the data runs out, a stop command or `stop`.
    A data-parallel learner's other ranks follow rank 0's orders instead (ranks.py)."""
    if world()[0] != 0:
        follow(cfg, resume)
        return
    run_dir = Path(cfg.run_dir)
    (run_dir / ENDED_FILE).unlink(missing_ok=True)  # an earlier run's reason must not pass for this one's
    try:
        service = build(cfg, resume, stop or threading.Event(), engine_built)
    except BaseException as exc:
        if not (run_dir / ENDED_FILE).exists():  # a start that failed before the loop existed (the load)
            why = "stopped (signal) while starting" if isinstance(exc, KeyboardInterrupt) else None
            write_ended(run_dir, why or f"the learner failed to start: {type(exc).__name__}: {exc}"[:2000], 0)
        raise
    ending = Ending()  # a signal (KeyboardInterrupt) ends it so
    try:
        ending = service.loop.run()
    except Exception as exc:  # ended.json must say so, not "stopped (signal)"
        ending = Ending(crashed=f"the learner failed: {type(exc).__name__}: {exc}"[:2000])
        raise
    finally:
        failed = close(service, ending)
    if failed is not None:
        raise SystemExit(f"learner: {failed}")
