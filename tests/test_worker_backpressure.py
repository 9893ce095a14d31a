"""A worker whose groups wait on a full trajectory stream (backpressure: the learner sets the pace, or is
paused) says so: its status reads `stream_full`, not `generating`, until the stream has room and the
groups are out. A real worker (its own `build`, the tiny model on a TorchEngine), a real reward service
over HTTP and a private redis-server."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from _reward import reward_service
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import free_port

from sparkrl.proto import encode_group
from sparkrl.proto.testing import random_group
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.feeder import feed_prompts
from sparkrl.services.common.settings import BusSettings, PromptSettings, SparkSettings
from sparkrl.services.common.settings.roles import RolloutConfig
from sparkrl.services.common.tasks.datasets import countdown_prompts
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.rollout import service

WORKER = "worker-under-backpressure"
MAXLEN = 4  # the trajectory stream's cap (its least)


@pytest.fixture
def reward_url(tmp_path: Path) -> Iterator[str]:
    with reward_service(tmp_path) as client:
        yield str(client.base_url).rstrip("/")


def _settings(model: Path, run_dir: Path, bus: BusSettings, reward_url: str) -> SparkSettings:
    return SparkSettings.model_validate(
        {
            "model": str(model),
            "run_dir": str(run_dir),
            "bus": bus.model_dump(),
            "reward": {"url": reward_url},
            "rollout": {
                "worker_id": WORKER,
                "prompts_per_batch": 1,
                "heartbeat_s": 0.2,
                "sampling": {"n": 2, "max_new_tokens": 6, "topk_logprobs": 4},
                "engine": {"kind": "torch", "threads": 1},
                "metrics": {"port": free_port()},
            },
        }
    )


def _wait(what: str, condition: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.05)


def test_a_worker_blocked_on_a_full_stream_reports_stream_full(
    tiny_model_dir: Path,  # noqa: F811
    bus_settings: BusSettings,
    reward_url: str,
    tmp_path: Path,
) -> None:
    bus_cfg = bus_settings.model_copy(update={"trajectory_maxlen": MAXLEN, "claim_idle_ms": 60_000})
    cfg = _settings(tiny_model_dir, tmp_path / "run", bus_cfg, reward_url)
    worker = service.build(RolloutConfig.of(cfg), threading.Event())
    with RedisBus(bus_cfg) as bus:
        telemetry = Telemetry(bus)

        def state() -> str | None:
            status = telemetry.workers().get(WORKER)
            return status.state if status is not None else None

        try:
            rng = np.random.default_rng(0)
            for _ in range(MAXLEN):  # the learner has not read these: the stream is at its cap
                group = random_group(rng, n=2, T=4, k=4, vocab_size=300)
                assert bus.publish_group(group.group_id, encode_group(group))
            prompts = list(countdown_prompts(PromptSettings(task="countdown", count=1, seed=5)))
            assert feed_prompts(bus, prompts).published == 1
            step = threading.Thread(target=worker.run_step, daemon=True)
            step.start()
            _wait("the worker to report the full stream", lambda: state() == "stream_full")
            time.sleep(1.0)  # several heartbeats: it stays so while the stream stays full
            assert state() == "stream_full" and step.is_alive()

            entries = bus.read("trajectories", "learner", MAXLEN, block_ms=0)  # the learner makes room
            assert len(entries) == MAXLEN
            bus.ack("trajectories", [e.entry_id for e in entries])
            step.join(30)
            assert not step.is_alive() and worker.state.groups_published == 1
            _wait("the worker to report generating again", lambda: state() == "generating", timeout_s=10)
        finally:
            service.close(worker)
