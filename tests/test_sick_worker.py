"""A sick model is not a bad prompt: a real rollout worker (its own `build`, a real TorchEngine on the tiny
model, a private redis-server) whose weights turn non-finite stops taking prompts, says it is unhealthy
and leaves its prompts to the fleet; prompts that cannot be taken are dead-lettered alone, and a burst of
them holds the feed with an alert; the learner's end reason counts dead letters apart from trained."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import torch
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import free_port

from sparkrl.proto import Prompt, ResumeCommand, WorkerStatus, encode_group
from sparkrl.proto.telemetry import StateEvent
from sparkrl.proto.testing import random_group
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.feeder import feed_held, feed_prompts, mark_fed
from sparkrl.services.common.settings import (
    BusSettings,
    LearnerSettings,
    PromptFormat,
    PromptSettings,
    SparkSettings,
    TorchEngineSettings,
)
from sparkrl.services.common.settings.roles import RolloutConfig
from sparkrl.services.common.tasks.datasets import countdown_prompts
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.learner.collect import BatchCollector
from sparkrl.services.learner.data_end import Tally
from sparkrl.services.learner.validate import ModelLimits
from sparkrl.services.rollout import service
from sparkrl.services.rollout.health import diagnose, is_model_fault, probe
from sparkrl.services.rollout.torch_engine import TorchEngine
from sparkrl.services.rollout.worker import Worker

WORKER = "worker-under-test"
PER_BATCH = 2


def worker_settings(model: Path, run_dir: Path, bus: BusSettings, **rollout: object) -> SparkSettings:
    """One worker's tree: the tiny model, short completions, a reward service that is not there (nothing
    here needs scores, and a batch that reaches scoring gives up in a second, its prompts unacked)."""
    return SparkSettings.model_validate(
        {
            "model": str(model),
            "run_dir": str(run_dir),
            "bus": bus.model_dump(),
            "reward": {"url": f"http://127.0.0.1:{free_port()}"},
            "rollout": {
                "worker_id": WORKER,
                "prompts_per_batch": PER_BATCH,
                "sampling": {"n": 2, "max_new_tokens": 6, "topk_logprobs": 4},
                "engine": {"kind": "torch", "threads": 1},
                "metrics": {"port": free_port()},
                "reward_deadline_s": 1.0,
                "reward_retries": 1,
                **rollout,
            },
        }
    )


@pytest.fixture
def make_worker(
    tiny_model_dir: Path,  # noqa: F811
    bus_settings: BusSettings,
    tmp_path: Path,
) -> Iterator[Callable[..., Worker]]:
    built: list[Worker] = []

    def make(**rollout: object) -> Worker:
        cfg = worker_settings(tiny_model_dir, tmp_path / "run", bus_settings, **rollout)
        built.append(service.build(RolloutConfig.of(cfg), threading.Event()))
        return built[-1]

    yield make
    for worker in built:
        service.close(worker)


def feed(bus: RedisBus, count: int, text: str | None = None) -> list[str]:
    prompts = list(countdown_prompts(PromptSettings(task="countdown", count=count, seed=3)))
    if text is not None:
        prompts = [p.model_copy(update={"text": text}) for p in prompts]
    assert feed_prompts(bus, prompts).published == count
    return [p.prompt_id for p in prompts]


def state_events(telemetry: Telemetry) -> list[StateEvent]:
    events = telemetry.follow({"states": "0-0"}, block_ms=None)
    return [e.message for e in events if isinstance(e.message, StateEvent)]


def healthz(worker: Worker) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{worker.server.port}/healthz", timeout=5)


# ── what a failed generation says ─────────────────────────────────────────────────────────────────────


def test_torch_s_non_finite_sampling_error_names_the_model_not_the_prompt() -> None:
    with pytest.raises(RuntimeError) as raised:
        torch.multinomial(torch.tensor([[float("nan"), 1.0]]), 1)
    assert is_model_fault(raised.value)
    assert is_model_fault(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_model_fault(ValueError("prompt 0 has token ids outside [0, 260)"))


def test_a_prompt_the_engine_refuses_is_found_alone_and_the_others_are_generated(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    engine = TorchEngine(tiny_model_dir, TorchEngineSettings(threads=1))
    sampling = worker_settings(tiny_model_dir, Path("."), BusSettings()).rollout.sampling
    good = engine.tokenizer("Use 1 2 to make 3.")["input_ids"]
    batch = [good, [5, engine.vocab_size + 7], good]  # the middle one's ids are past the vocabulary
    try:
        with pytest.raises(ValueError) as raised:
            engine.generate(batch, sampling)
        found = diagnose(engine, batch, sampling, raised.value, PromptFormat())
        assert found.sick is None and list(found.bad) == [1] and "outside" in found.bad[1]
        assert sorted(found.completions) == [0, 2] and len(found.completions[0]) == sampling.n
        assert probe(engine, sampling, PromptFormat()) is None
    finally:
        engine.close()


# ── the worker ────────────────────────────────────────────────────────────────────────────────────────


def test_a_worker_with_non_finite_weights_stops_taking_prompts_and_gives_them_back(
    make_worker: Callable[..., Worker], bus_settings: BusSettings
) -> None:
    worker = make_worker()
    bus, telemetry = worker.bus, worker.telemetry
    feed(bus, 6)
    healthy = {name: t.detach().clone() for name, t in worker.engine.model.state_dict().items()}
    # What a learner that stepped with lr=1e9 would broadcast: every weight NaN.
    worker.engine.load_weights(((name, torch.full_like(t, float("nan"))) for name, t in healthy.items()), 1)

    service.step(worker)  # takes a batch, generation fails: the model is at fault, not the prompts
    assert worker.state.state == "unhealthy"
    assert "probability tensor contains" in (worker.state.state_reason or "")
    assert bus.dead_letter_count() == 0, [d.reason for d in bus.dead_letters()]
    held = bus.pending_info("prompts")
    assert (held.pending, held.lag) == (PER_BATCH, 6 - PER_BATCH)  # taken, not acknowledged
    assert worker.state.in_flight == []  # no longer kept alive: the fleet reclaims them
    status: WorkerStatus = telemetry.workers()[WORKER]
    assert status.state == "unhealthy" and "probability tensor" in (status.state_reason or "")
    reply = healthz(worker)
    assert reply.status_code == 503 and reply.json()["status"] == "unhealthy"
    (event,) = [e for e in state_events(telemetry) if e.target == f"worker:{WORKER}"]
    assert (event.previous, event.state) == ("generating", "unhealthy") and event.detail

    for _ in range(3):  # unhealthy, it takes nothing more (and its engine is not probed: same weights)
        service.step(worker)
    assert bus.pending_info("prompts") == held and worker.state.state == "unhealthy"

    # Another worker claims them once they are idle for bus.claim_idle_ms (the bus's reclaim, as a plain
    # XAUTOCLAIM: reading new prompts too would blur what is counted): nothing was lost or burnt.
    client = redis.Redis.from_url(bus_settings.url)
    reclaimed: list[bytes] = []
    while len(reclaimed) < PER_BATCH:
        _, claimed, _ = client.xautoclaim(bus.stream_key("prompts"), bus.groups["prompts"], "another-worker",
                                          bus_settings.claim_idle_ms, "0-0", count=10)  # fmt: skip
        reclaimed += [entry_id for entry_id, _ in claimed]
    client.close()
    assert bus.pending_info("prompts").lag == 6 - PER_BATCH and bus.dead_letter_count() == 0

    # New weights that sample: the probe generates, the worker takes prompts again.
    worker.engine.load_weights(healthy.items(), 2)
    service.step(worker)
    assert worker.health.sick is None and worker.state.state_reason is None
    assert healthz(worker).json()["status"] == "ok"
    assert [(e.previous, e.state) for e in state_events(telemetry)][-1] == ("unhealthy", "generating")
    # It generated a batch (scoring then found no reward service): still no dead letter.
    assert bus.pending_info("prompts").lag == 6 - 2 * PER_BATCH and bus.dead_letter_count() == 0


def test_a_burst_of_dead_letters_holds_the_feed_with_an_alert_until_resume(
    make_worker: Callable[..., Worker], caplog: pytest.LogCaptureFixture
) -> None:
    from sparkrl.services.control.commands import Commander

    # Every prompt is too long for this worker's limit: each is dead-lettered, alone, with the reason.
    worker = make_worker(max_prompt_tokens=8, health={"dead_letter_burst": 3, "dead_letter_window_s": 600})
    bus, telemetry = worker.bus, worker.telemetry
    feed(bus, 10, text="Use 1 2 3 4 5 6 7 8 9 10 11 12 to make 13.")
    service.step(worker)
    assert bus.dead_letter_count() == PER_BATCH and feed_held(bus) is None  # 2 ≤ 3: not a burst yet
    service.step(worker)
    hold = feed_held(bus)
    assert hold is not None and "4 prompts dead-lettered" in (hold.detail or "")
    assert "over rollout.max_prompt_tokens (8)" in (hold.detail or "")
    assert any("FEED HELD" in r.getMessage() for r in caplog.records)
    assert any(e.target == "feed" and e.state == "held" for e in state_events(telemetry))

    for _ in range(3):  # held: nothing more is taken, nothing more is burnt
        service.step(worker)
    assert worker.state.state == "held" and telemetry.workers()[WORKER].state == "held"
    assert bus.dead_letter_count() == 2 * PER_BATCH and bus.pending_info("prompts").lag == 10 - 2 * PER_BATCH
    assert healthz(worker).status_code == 200  # a held feed is not the worker's ill

    # `sparkrl resume` (the control service's command) lifts the hold; the worker answers it.
    commander = Commander(bus, telemetry, timeout_s=60)
    answered: list[object] = []
    issuing = threading.Thread(
        target=lambda: answered.append(commander.issue(ResumeCommand(command="resume")))
    )
    issuing.start()
    while issuing.is_alive():  # the worker's control boundary, as each step begins with
        worker.control.boundary()
        issuing.join(0.05)
    (response,) = answered
    assert "the feed hold is lifted" in response.results[0].detail  # type: ignore[attr-defined]
    assert feed_held(bus) is None
    assert [e.state for e in state_events(telemetry) if e.target == "feed"] == ["held", "flowing"]
    service.step(worker)  # prompts flow again (these are still too long: dead-lettered, no new burst yet)
    assert worker.state.state != "held" and bus.pending_info("prompts").lag == 10 - 3 * PER_BATCH


# ── the learner's end reason ──────────────────────────────────────────────────────────────────────────


def test_the_end_reason_counts_dead_lettered_prompts_apart_from_trained_ones(
    bus_settings: BusSettings,
) -> None:
    with RedisBus(bus_settings) as bus:
        prompts = [
            Prompt(prompt_id=f"p{i}", task="countdown", text=f"Use {i} to make {i}.") for i in range(6)
        ]
        report = feed_prompts(bus, prompts)
        entries = bus.read("prompts", "w", 6)
        for entry in entries[:2]:  # what a worker does with prompts it cannot take
            assert bus.dead_letter("prompts", entry, "prompt has 900 tokens, over rollout.max_prompt_tokens")
        for index, entry in enumerate(entries[2:]):  # and with those it sampled: publish, acknowledge
            group = random_group(
                np.random.default_rng(index), n=2, T=4, k=4, vocab_size=260, max_new_tokens=8
            )
            fresh = [c.model_copy(update={"policy_versions": np.zeros_like(c.policy_versions)})
                     for c in group.completions]  # fmt: skip
            assert bus.publish_group(
                group.group_id, encode_group(group.model_copy(update={"completions": fresh}))
            )
            bus.ack("prompts", [entry.entry_id])
        mark_fed(bus, report, epochs=1)
        collector = BatchCollector(bus, LearnerSettings(prompts_per_step=4), ModelLimits(260, None, True))
        batch = collector.fill(0, 4, lambda: False)  # the 4 sampled groups: one step, trained
        assert batch is not None and len(batch.groups) == 4
        bus.ack("trajectories", [e.entry_id for e in batch.entries])
        collector.progress = Tally(step=1, groups_trained=4)  # what the learner's train state says then
        assert collector.fill(1, 4, lambda: False) is None
        assert collector.exhausted == (
            "the data ran out: of the 6 prompts fed (1 epoch), 4 were trained, 2 dead-lettered (2 prompts by "
            "the workers, 0 groups by the learner; `sparkrl dead` lists them with the reason) and 0 dropped "
            "(neither trained nor dead-lettered)"
        )
        assert collector.counts is not None and collector.counts.dead_lettered_prompts == 2
