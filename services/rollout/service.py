"""The rollout worker as a service: `build` its parts from its role's settings (`RolloutConfig`), `step`
its loop once, `close` it.

A plain process (`sparkrl rollout`) and a Ray actor (`sparkrl up --ray`) drive the same three; neither
this module nor the worker touches signals: whoever runs the loop owns them and sets `stop`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from functools import partial
from pathlib import Path

from sparkrl.proto.run_files import EXIT_UNFIT
from sparkrl.services.common.bus import BusStopping, RedisBus
from sparkrl.services.common.control_channel import ControlReader
from sparkrl.services.common.environments import check_environment
from sparkrl.services.common.metrics_server import MetricsServer
from sparkrl.services.common.modeling import chat_format_at_start
from sparkrl.services.common.ownership import refuse_foreign_owner
from sparkrl.services.common.prompt_limits import (
    PromptBudgetError,
    PromptLimits,
    model_context,
    resolve_limits,
)
from sparkrl.services.common.recovery import warn_if_not_persistent
from sparkrl.services.common.reward_client import RewardClient
from sparkrl.services.common.settings.roles import RolloutConfig
from sparkrl.services.common.start_clock import StartClock
from sparkrl.services.common.telemetry import Telemetry, worker_target
from sparkrl.services.common.weight_sync import WeightReceiver
from sparkrl.services.rollout.announcements import AnnouncementGate
from sparkrl.services.rollout.catch_up import model_dir_for
from sparkrl.services.rollout.control import WorkerControl
from sparkrl.services.rollout.engine import WeightsDoNotFit
from sparkrl.services.rollout.engines import make_engine
from sparkrl.services.rollout.episode_handover import EpisodeHandover
from sparkrl.services.rollout.health import HealthGuard
from sparkrl.services.rollout.heartbeat import Heartbeat, WorkerState
from sparkrl.services.rollout.install import VersionInstaller
from sparkrl.services.rollout.lockstep import Lockstep
from sparkrl.services.rollout.metrics import WorkerMetrics
from sparkrl.services.rollout.partials import Handover
from sparkrl.services.rollout.play_batch import EpisodePlayer
from sparkrl.services.rollout.worker import PAUSED_POLL_S, Worker

log = logging.getLogger("sparkrl.rollout")

LOCKSTEP_POLL_S = 0.005  # how often a worker in lockstep looks for the next version


def build(cfg: RolloutConfig, stop: threading.Event) -> Worker:
    """Bus, model (the learner's when ours is not there), engine, reward client, control, weight sync,
    heartbeat and /metrics — started, announced, ready for `step`."""
    clock = StartClock()
    clock.mark("imports")
    worker_id = cfg.rollout.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    bus = RedisBus(cfg.bus, stop)  # told to stop while Redis is down, it stops reconnecting
    refuse_foreign_owner(bus, cfg.bus.run_id, f"worker {worker_id}")  # another run's prompts are not ours
    warn_if_not_persistent(bus)
    gate = AnnouncementGate(bus, cfg.sync.secret, Path(cfg.run_dir))
    model = model_dir_for(cfg.model, Path(cfg.run_dir), gate, cfg.sync.secret, cfg.rollout.model_wait_s, stop)
    limits = _prompt_limits(cfg, Path(model))
    try:  # the tokenizer alone, before the engine's start: a format the model cannot render stops us here
        log.info("%s", chat_format_at_start(model, cfg.rollout.prompt_format, cfg.rollout.eos_tokens))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    _check_agent(cfg, Path(model))
    native = cfg.sync.backend == "vllm_nccl"  # vLLM's own transfer engine receives the weights
    engine = make_engine(model, cfg.rollout.engine, native_transfer=native, eos_tokens=cfg.rollout.eos_tokens)
    clock.mark("engine")
    installer = VersionInstaller(engine, model)
    telemetry, metrics = Telemetry(bus), WorkerMetrics(worker_id)
    state = WorkerState(worker_id, cfg.rollout.engine.kind, policy_version=engine.policy_version)
    control = WorkerControl(
        ControlReader(bus, telemetry, worker_target(worker_id)), cfg.rollout.sampling, stop
    )
    heartbeat = Heartbeat(telemetry, state, lambda: control.sampling, cfg.rollout.heartbeat_s)
    worker = Worker(
        bus=bus,
        engine=engine,
        reward=_reward_client(cfg, stop),
        cfg=cfg.rollout.model_copy(update={"sampling": control.sampling}),  # the fleet's live values
        limits=limits,
        state=state,
        control=control,
        metrics=metrics,
        stop=stop,
        gate=gate,
        receiver=_receiver(worker_id, cfg, installer),
        installer=installer,
        heartbeat=heartbeat,
        telemetry=telemetry,
        secret=cfg.sync.secret,
        server=MetricsServer(cfg.rollout.metrics, metrics.registry, lambda: _health(state)),
        lockstep=Lockstep(cfg.rollout.lockstep_groups, cfg.rollout.lockstep_wait_s),
        health=HealthGuard(
            engine, telemetry, state, heartbeat, metrics, cfg.rollout.health, cfg.rollout.prompt_format
        ),
        handover=Handover(
            bus,
            cfg.rollout.partial,
            worker_id,
            engine.vocab_size,
            engine.continues_prefixes,
            lambda: engine.policy_version,
            partial(_learner_bound, telemetry),
            metrics,
        ),
        player=EpisodePlayer(
            engine,
            bus,
            metrics,
            state,
            heartbeat,
            stop,
            EpisodeHandover(bus, cfg.rollout.partial, cfg.rollout.agent, worker_id),
        ),
    )
    worker.server.start()
    clock.mark("ready")
    state.startup_s = clock.phases
    worker.heartbeat.beat()
    worker.heartbeat.start()
    log.info("worker %s up: model %s, engine %s", worker_id, model, cfg.rollout.engine.kind)
    return worker


def _prompt_limits(cfg: RolloutConfig, model: Path) -> PromptLimits:
    """How long a prompt may be, from the model's context; a budget that cannot fit it stops the worker
    with the fix, before the engine is built."""
    try:
        limits = resolve_limits(cfg.rollout, model)
    except PromptBudgetError as exc:
        raise SystemExit(str(exc)) from None
    if limits.max_tokens is None:
        log.warning("no prompt limit: %s does not say its context, rollout.max_prompt_tokens is unset", model)
    else:
        log.info("prompts limited to %s", limits.describe())
    return limits


def _check_agent(cfg: RolloutConfig, model: Path) -> None:
    """`rollout.agent`: the environment played here loads, before the engine (else the worker stops with
    the fix), and an episode's context stays within the model's (`max_tokens` lowered to it, said)."""
    agent = cfg.rollout.agent
    if agent.environment is None:
        return
    if agent.url is None:
        try:
            check_environment(agent.environment, agent.reward)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    context = model_context(model, getattr(cfg.rollout.engine, "max_model_len", None))
    if context is not None and agent.max_tokens > context:
        log.info("episodes held to the model's context: %d tokens (rollout.agent.max_tokens %d)",
                 context, agent.max_tokens)  # fmt: skip
        agent.max_tokens = context


def _receiver(worker_id: str, cfg: RolloutConfig, installer: VersionInstaller) -> WeightReceiver:
    """The weight receiver `sync.backend` names; for a vLLM engine one whose acknowledgement waits until
    vLLM holds the version (loaded in place, its checksum taken from what vLLM holds)."""
    if cfg.rollout.engine.kind == "vllm":
        from sparkrl.services.rollout.vllm_engine import VllmEngine
        from sparkrl.services.rollout.vllm_transfer import receiver_for

        assert isinstance(installer.engine, VllmEngine)  # make_engine builds the engine `kind` names
        return receiver_for(worker_id, cfg.sync, installer)
    sync = cfg.sync
    return WeightReceiver(
        worker_id, backend=sync.backend, timeout_s=sync.timeout_s, secret=sync.secret, delta=sync.delta
    )


def _learner_bound(telemetry: Telemetry) -> int | None:
    """The learner's max_staleness in force (its status), bounding how stale a continued sample may be."""
    status = telemetry.learner()
    return None if status is None or not Telemetry.learner_alive(status) else status.max_staleness


def _reward_client(cfg: RolloutConfig, stop: threading.Event) -> RewardClient:
    r = cfg.rollout
    return RewardClient(
        cfg.reward.url, r.reward_timeout_s, r.reward_retries, deadline_s=r.reward_deadline_s, stop=stop
    )


def _health(state: WorkerState) -> dict[str, str | None]:
    """`/healthz`: 503 while the model or engine fails to generate (a held feed is not the worker's ill)."""
    status = "unhealthy" if state.state == "unhealthy" else "ok"
    return {"status": status, "state": state.state, "reason": state.state_reason}


def step(worker: Worker) -> None:
    """One turn: control commands, the newest weights, then a batch (or, paused, unhealthy or held by the
    feed, a short wait)."""
    state, control = worker.state, worker.control
    state.progress_at = time.time()
    sampling = control.boundary()
    if sampling is not worker.cfg.sampling:  # a live change: the next batch samples with the new values
        worker.cfg = worker.cfg.model_copy(update={"sampling": sampling})
    worker.sync()
    if not worker.health.recovered(worker.cfg.sampling):
        worker.stop.wait(PAUSED_POLL_S)  # following weights and answering control; new ones are probed
        return
    worker.metrics.paused.set(float(control.paused))
    if control.paused:
        if state.state != "paused":
            state.state, state.tokens_per_s = "paused", 0.0  # the fleet's speed reads 0 while paused
            worker.heartbeat.beat()
        worker.stop.wait(PAUSED_POLL_S)
        return
    if worker.health.held():
        worker.stop.wait(PAUSED_POLL_S)
        return
    if worker.lockstep.holds(worker.engine.policy_version):
        worker.stop.wait(LOCKSTEP_POLL_S)  # our share of this version is out: the next one comes soon
        return
    worker.run_step()


def close(worker: Worker) -> None:
    """Say `stopping`, then release the engine, the weight-sync group and the connections."""
    worker.state.state = "stopping"
    worker.heartbeat.stopped.set()
    worker.heartbeat.beat()
    worker.server.close()
    worker.receiver.close()
    worker.engine.close()
    worker.reward.close()
    worker.bus.close()
    log.info("worker %s stopped after %d groups", worker.state.worker_id, worker.state.groups_published)


def main(cfg: RolloutConfig, stop: threading.Event | None = None) -> None:
    """Build, step until `stop` is set (a signal, a stop command, the Ray driver), close."""
    stop = stop or threading.Event()
    try:
        worker = build(cfg, stop)
    except WeightsDoNotFit as exc:  # an engine that cannot update this family
        log.error("this worker's engine cannot take the learner's weights: %s", exc)
        raise SystemExit(EXIT_UNFIT) from None
    try:
        while not stop.is_set():
            step(worker)
    except BusStopping as exc:
        log.warning("stopping without Redis (%s): the prompts in hand stay pending, for another worker", exc)
    except WeightsDoNotFit as exc:  # another model, or an engine that cannot update this family
        log.error("the learner's weights do not fit this worker's engine: %s", exc)
        raise SystemExit(EXIT_UNFIT) from None
    finally:
        close(worker)
