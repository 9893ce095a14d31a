"""The read side of the control API: views over the telemetry channel (statuses, sync history, step rows)."""

from __future__ import annotations

import time

from sparkrl.proto import LearnerStatus, StatusView, WorkersView, WorkerView
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.control_channel import read_control_state
from sparkrl.services.common.telemetry import Telemetry


def status_view(telemetry: Telemetry, bus: RedisBus) -> StatusView:
    """`GET /api/v1/status`."""
    learner = telemetry.learner()
    alive = Telemetry.learner_alive(learner)
    workers = telemetry.live_workers()
    sampling: dict[str, float] = {}
    for worker in workers.values():  # the workers' own reports: what is really in force
        if worker.temperature is not None:
            sampling.setdefault("temperature", worker.temperature)
        if worker.top_p is not None:
            sampling.setdefault("top_p", worker.top_p)
    base = StatusView(
        state="unknown",
        learner_alive=False,
        step=0,
        policy_version=0,
        generation_tokens_per_s=sum(w.tokens_per_s for w in workers.values()),
        groups_trained=0,
        groups_dropped_stale=0,
        workers_live=len(workers),
        paused=read_control_state(bus).paused,
        sampling=sampling,
    )
    return base if learner is None else _with_learner(base, learner, alive)


def _with_learner(base: StatusView, learner: LearnerStatus, alive: bool) -> StatusView:
    # A learner that stopped says so; one whose heartbeat went quiet is `unknown` (restarting, or gone).
    state = learner.state if alive or learner.state == "stopped" else "unknown"
    return base.model_copy(
        update={
            "state": state,
            "learner_alive": alive,
            "heartbeat_age_s": max(0.0, time.time() - learner.heartbeat_at),
            "step": learner.step,
            "max_steps": learner.max_steps,
            "policy_version": learner.policy_version,
            "last_loss": learner.last_loss,
            "last_reward": learner.last_reward,
            "last_entropy": learner.last_entropy,
            "tokens_per_s": learner.tokens_per_s,
            "groups_trained": learner.groups_trained,
            "groups_dropped_stale": learner.groups_dropped_stale,
            "hyperparameters": learner.hyperparameters,
            "last_checkpoint": learner.last_checkpoint,
            "checkpoint_failure": learner.checkpoint_failure,
            "disk_failure": learner.disk_failure,
            "learner": learner,
        }
    )


def workers_view(telemetry: Telemetry) -> WorkersView:
    """`GET /api/v1/workers`: each worker against the learner's version and the newest broadcast."""
    learner = telemetry.learner()
    version = learner.policy_version if Telemetry.learner_alive(learner) and learner else None
    last = telemetry.last_sync()
    now = time.time()
    views = []
    for worker_id, s in telemetry.workers().items():
        lag = version - s.policy_version if version is not None and s.policy_version is not None else None
        views.append(
            WorkerView(
                worker_id=worker_id,
                engine=s.engine,
                state=s.state,
                policy_version=s.policy_version,
                lag=lag,
                weights_checksum=s.weights_checksum,
                last_sync_seconds=s.last_sync_seconds,
                last_sync_bytes=s.last_sync_bytes,
                sync_failures=s.sync_failures,
                heartbeat_age_s=max(0.0, now - s.heartbeat_at),
                tokens_per_s=s.tokens_per_s,
                prompts_in_flight=s.prompts_in_flight,
                groups_published=s.groups_published,
                temperature=s.temperature,
                top_p=s.top_p,
                in_broadcast_group=last is not None and worker_id in last.members,
                dropped_reason=last.dropped.get(worker_id) if last is not None else None,
                episodes=s.episodes,
                judge=s.judge,
            )
        )
    return WorkersView(learner_version=version, workers=views)
