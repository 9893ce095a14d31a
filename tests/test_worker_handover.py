"""A stop command reaches a worker mid-generation (`rollout.partial`): it stops at the next decoding step,
saves its unfinished group and releases the prompt; the next worker continues the saved samples from their
last token, publishes the group once (saying what it continued) and deletes the record. Real workers (their
own `build`, the tiny model on a TorchEngine), a real reward service over HTTP and a private redis-server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _reward import reward_service
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import free_port

from sparkrl.proto import (
    ControlCommand,
    PartialGroup,
    StopCommand,
    decode_group,
    decode_message,
    encode_message,
    group_id_for,
)
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.control_channel import CONTROL_LOG
from sparkrl.services.common.feeder import feed_prompts
from sparkrl.services.common.settings import BusSettings, PromptSettings, SparkSettings
from sparkrl.services.common.settings.roles import RolloutConfig
from sparkrl.services.common.tasks.datasets import countdown_prompts
from sparkrl.services.rollout import service
from sparkrl.services.rollout.partials import partial_key
from sparkrl.services.rollout.worker import Worker

T = 160  # every sample this long (min_new_tokens)
STEP_S = 0.01  # worker-0's decoding steps slowed to at least this: its batch outlasts CONTROL_POLL_S


@pytest.fixture
def reward_url(tmp_path: Path) -> Iterator[str]:
    with reward_service(tmp_path) as client:
        yield str(client.base_url).rstrip("/")


def build(worker_id: str, model: Path, run_dir: Path, bus: BusSettings, reward_url: str) -> Worker:
    cfg = SparkSettings.model_validate(
        {
            "model": str(model),
            "run_dir": str(run_dir),
            "bus": bus.model_dump(),
            "reward": {"url": reward_url},
            "rollout": {
                "worker_id": worker_id,
                "prompts_per_batch": 1,
                "heartbeat_s": 0.2,
                "sampling": {"n": 2, "max_new_tokens": T, "min_new_tokens": T, "topk_logprobs": 4},
                "engine": {"kind": "torch", "threads": 1},
                "metrics": {"port": free_port()},
            },
        }
    )
    return service.build(RolloutConfig.of(cfg), threading.Event())


def test_a_stop_command_mid_generation_hands_the_group_to_the_next_worker(
    tiny_model_dir: Path,  # noqa: F811
    bus_settings: BusSettings,
    reward_url: str,
    tmp_path: Path,
) -> None:
    bus_cfg = bus_settings.model_copy(update={"claim_idle_ms": 60_000})  # taken at once only if released
    with RedisBus(bus_cfg) as bus:
        [prompt] = countdown_prompts(PromptSettings(task="countdown", count=1, seed=3))
        assert feed_prompts(bus, [prompt]).published == 1
        key = partial_key(group_id_for(prompt.prompt_id))

        first = build("worker-0", tiny_model_dir, tmp_path / "run", bus_cfg, reward_url)
        try:
            # Issued before the batch: the worker reads the control stream every CONTROL_POLL_S while it
            # generates, so it sees the stop a fraction of a second in; each decoding step slowed to at
            # least STEP_S, the batch lasts T × STEP_S, whatever the machine.
            forward = first.engine.model.forward
            first.engine.model.forward = lambda *a, **kw: (time.sleep(STEP_S), forward(*a, **kw))[1]
            stop = ControlCommand(command_id="s", issued_at=time.time(), body=StopCommand(command="stop"))
            bus.logs.append(CONTROL_LOG, encode_message(stop))
            assert first.run_step()
            assert first.stop.is_set()
        finally:
            service.close(first)
        assert bus.pending_info("trajectories").lag == 0  # nothing published
        raw = bus.get_value(key)
        assert raw is not None, "worker-0 saved nothing"
        saved = decode_message(raw, PartialGroup)
        assert saved.producer == "worker-0"
        assert all(c.finish_reason == "abort" and 0 < c.num_tokens < T for c in saved.completions)

        second = build("worker-1", tiny_model_dir, tmp_path / "run", bus_cfg, reward_url)
        try:
            assert second.run_step()  # the released prompt at once, not after claim_idle_ms
        finally:
            service.close(second)
        [entry] = bus.read("trajectories", "learner", 10, block_ms=0)
        group = decode_group(entry.payload)
        assert group.group_id == saved.group_id
        assert (group.producer, group.resumed_from) == ("worker-1", "worker-0")
        assert group.resumed_tokens == [c.num_tokens for c in saved.completions]
        for made, before in zip(group.completions, saved.completions, strict=True):
            n = before.num_tokens
            assert made.num_tokens == T and made.finish_reason == "length"
            np.testing.assert_array_equal(made.token_ids[:n], before.token_ids)
            np.testing.assert_array_equal(made.logprobs[:n], before.logprobs)
            np.testing.assert_array_equal(made.policy_versions[:n], before.policy_versions)
        assert bus.get_value(key) is None  # deleted once the group was out
        assert bus.pending_info("prompts").pending == 0  # acknowledged, once
