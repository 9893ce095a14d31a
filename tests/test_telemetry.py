"""The telemetry channel and the control stream on a private redis-server: logs, statuses, step history
across a resume, paging, following from a cursor, and the control reader's start-up state."""

from __future__ import annotations

import time

import pytest

from sparkrl.proto import (
    CommandResult,
    ControlCommand,
    ControlState,
    LearnerStatus,
    PauseCommand,
    StateEvent,
    StepMetrics,
    SyncEvent,
    WorkerStatus,
    encode_message,
)
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.bus.logs import START
from sparkrl.services.common.control_channel import CONTROL_LOG, CONTROL_STATE_KEY, ControlReader
from sparkrl.services.common.settings import BusSettings
from sparkrl.services.common.telemetry import LEARNER_ALIVE_S, Telemetry, worker_target


@pytest.fixture
def telemetry(bus_settings: BusSettings) -> Telemetry:
    bus = RedisBus(bus_settings.model_copy(update={"telemetry_maxlen": 1000}))
    yield Telemetry(bus)
    bus.close()


def row(step: int, version: int | None = None) -> StepMetrics:
    return StepMetrics(
        step=step, policy_version=version or step, time=1.0, metrics={"loss/value": -0.1 * step}
    )


def sync(version: int, outcome: str = "ok") -> SyncEvent:
    return SyncEvent(version=version, epoch=1, announced_at=1.0, outcome=outcome, bytes=10, buckets=1)


def worker(worker_id: str, state: str = "generating", version: int | None = 3) -> WorkerStatus:
    return WorkerStatus(
        worker_id=worker_id,
        engine="torch",
        state=state,
        policy_version=version,
        tokens_per_s=10.0,
        groups_published=1,
        prompts_in_flight=0,
        heartbeat_at=time.time(),
    )


def test_step_rows_are_namespaced() -> None:
    with pytest.raises(ValueError, match="metric names must be"):
        StepMetrics(step=1, policy_version=1, time=1.0, metrics={"reward_mean": 0.5})
    with pytest.raises(ValueError):
        StepMetrics(step=1, policy_version=1, time=1.0, metrics={"loss/value": float("nan")})
    assert row(2).value("loss/value") == pytest.approx(-0.2) and row(2).value("loss/entropy") is None


def test_steps_since_and_limit_oldest_first(telemetry: Telemetry) -> None:
    assert telemetry.steps() == [] and telemetry.last_step() is None
    for step in range(1, 601):  # more than one read-back chunk
        telemetry.append(row(step))
    assert [r.step for r in telemetry.steps(since=595)] == [596, 597, 598, 599, 600]
    assert [r.step for r in telemetry.steps(since=0, limit=3)] == [1, 2, 3]
    assert telemetry.last_step().step == 600
    assert telemetry.steps(since=600) == []


def test_a_resume_replaces_the_rolled_back_steps(telemetry: Telemetry) -> None:
    # Steps 1..15 ran, the learner died, resumed from checkpoint 10 and redid 11 and 12.
    for step in [*range(1, 16), 11, 12]:
        telemetry.append(row(step, version=step + (100 if step <= 15 else 0)))
    steps = telemetry.steps()
    assert [r.step for r in steps] == list(range(1, 13))
    assert [r.step for r in telemetry.steps(since=10)] == [11, 12]
    assert telemetry.last_step().step == 12


def test_sync_history_pages_newest_first(telemetry: Telemetry) -> None:
    for version in range(1, 8):
        telemetry.append(sync(version, "failed" if version == 4 else "ok"))
    page, total = telemetry.syncs(offset=0, limit=3)
    assert total == 7 and [e.version for e in page] == [7, 6, 5]
    page, _ = telemetry.syncs(offset=3, limit=3)
    assert [(e.version, e.outcome) for e in page] == [(4, "failed"), (3, "ok"), (2, "ok")]
    assert telemetry.syncs(offset=10, limit=3)[0] == []
    assert telemetry.last_sync().version == 7


def test_follow_yields_only_what_comes_after_the_cursor(telemetry: Telemetry) -> None:
    telemetry.append(row(1))
    cursors = telemetry.cursors_now()
    assert telemetry.follow(cursors, block_ms=None) == []
    telemetry.append(row(2))
    telemetry.append(sync(2))
    telemetry.append(StateEvent(target="learner", state="paused", previous="training", step=2, at=1.0))
    result = CommandResult(
        command_id="c1", command="pause", target="learner", outcome="applied", detail="ok", at=1.0
    )
    telemetry.append(result)
    events = telemetry.follow(cursors, block_ms=100)
    assert sorted(e.kind for e in events) == ["command", "state", "step", "sync"]
    assert next(e for e in events if e.kind == "step").message.step == 2
    assert telemetry.follow(cursors, block_ms=None) == []  # the cursors advanced in place
    started = time.monotonic()
    assert telemetry.follow(cursors, block_ms=200) == []
    assert time.monotonic() - started >= 0.15  # it waited for news


def test_a_malformed_record_is_skipped_not_fatal(telemetry: Telemetry) -> None:
    telemetry.append(row(1))
    telemetry.bus.logs.append("metrics", b'{"step": "not a number"}')
    telemetry.append(row(2))
    assert [r.step for r in telemetry.steps()] == [1, 2]


def test_logs_are_capped(bus_settings: BusSettings) -> None:
    bus = RedisBus(bus_settings.model_copy(update={"telemetry_maxlen": 100}))
    for step in range(1, 1001):
        bus.logs.append("metrics", row(step).model_dump_json())
    assert 100 <= bus.logs.length("metrics") < 300  # approximate trimming, about the cap
    bus.close()


def test_statuses_and_liveness(telemetry: Telemetry) -> None:
    assert telemetry.learner() is None and not Telemetry.learner_alive(None)
    status = LearnerStatus(
        step=3, policy_version=3, state="training", groups_trained=1, group_epoch=1, heartbeat_at=time.time()
    )
    telemetry.put_learner(status)
    assert Telemetry.learner_alive(telemetry.learner())
    assert not Telemetry.learner_alive(status, now=status.heartbeat_at + LEARNER_ALIVE_S + 1)
    assert not Telemetry.learner_alive(status.model_copy(update={"state": "stopped"}))
    telemetry.put_worker(worker("w1"), ttl_s=30)
    telemetry.put_worker(worker("w0", state="stopping"), ttl_s=30)
    telemetry.put_worker(worker("w2"), ttl_s=0.05)
    time.sleep(0.1)
    assert list(telemetry.workers()) == ["w0", "w1"]  # w2's heartbeat expired
    assert list(telemetry.live_workers()) == ["w1"]  # a stopping worker gets no more broadcasts
    assert telemetry.worker_versions() == {"w1": 3}
    assert telemetry.wait_for_fleet(("w1",), 3, timeout_s=1.0)
    assert not telemetry.wait_for_fleet(("w1",), 4, timeout_s=0.2)


def _command(command_id: str) -> bytes:
    body = PauseCommand(command="pause")
    return encode_message(ControlCommand(command_id=command_id, issued_at=1.0, body=body))


def test_control_reader_starts_after_history_and_adopts_the_state(telemetry: Telemetry) -> None:
    bus = telemetry.bus
    bus.logs.append(CONTROL_LOG, _command("before-start"))
    state = ControlState(paused=True, sampling={"temperature": 0.7}, updated_at=1.0)
    bus.set_value(CONTROL_STATE_KEY, encode_message(state))
    reader = ControlReader(bus, telemetry, worker_target("w0"))
    assert reader.initial_state() == state  # the fleet is paused: a newcomer starts paused
    assert reader.cursor != START and not reader.pending()  # old commands are not replayed
    bus.logs.append(CONTROL_LOG, b"{not json")
    bus.logs.append(CONTROL_LOG, _command("after"))
    assert reader.pending()
    [command] = reader.poll()  # the malformed record is skipped
    assert command.command_id == "after" and reader.poll() == []
    result = reader.answer(command, "applied", "paused")
    assert result.target == "worker:w0" and result.command == "pause"
    [event] = telemetry.follow({"commands": START}, block_ms=None)
    assert event.message == result


def test_control_state_defaults_when_absent_or_malformed(telemetry: Telemetry) -> None:
    reader = ControlReader(telemetry.bus, telemetry, "learner")
    assert reader.initial_state().paused is False
    telemetry.bus.set_value(CONTROL_STATE_KEY, b'{"paused": "maybe"}')
    assert reader.initial_state().paused is False
