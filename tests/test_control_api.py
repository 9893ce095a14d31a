"""The control service over real HTTP (uvicorn on a loopback port) against a private redis-server: auth,
the reads, commands answered by a worker's real control loop (no engine), 409/422/504, events, and
schemathesis against its own OpenAPI. The learner's side runs in `test_control_live.py`."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import schemathesis
import uvicorn
from conftest import free_port
from hypothesis import HealthCheck, given, settings

from sparkrl.proto import EvalRecord, LearnerStatus, StepMetrics, SyncEvent, WorkerStatus
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.control_channel import ControlReader, read_control_state
from sparkrl.services.common.settings import BusSettings, ControlSettings, SamplingSettings
from sparkrl.services.common.telemetry import Telemetry, worker_target
from sparkrl.services.control.app import create_app
from sparkrl.services.rollout.control import WorkerControl

TOKEN = "s3cret-token"
MUTATING = [
    ("POST", "/api/v1/pause", None),
    ("POST", "/api/v1/resume", None),
    ("POST", "/api/v1/stop", {"checkpoint": False}),
    ("POST", "/api/v1/checkpoint", None),
    ("PATCH", "/api/v1/hyperparameters", {"lr": 1e-5}),
]


class Server:
    """uvicorn serving an app on a loopback port, in a thread of the test process."""

    def __init__(self, app: object) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@dataclass
class Responder:
    """A rollout worker's own control loop and heartbeat (the product's classes), without an engine."""

    telemetry: Telemetry
    worker_id: str
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    stopped: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        reader = ControlReader(self.telemetry.bus, self.telemetry, worker_target(self.worker_id))
        self.control = WorkerControl(reader, self.sampling, threading.Event())
        self.beat()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def beat(self) -> None:
        status = WorkerStatus(
            worker_id=self.worker_id,
            engine="torch",
            state="paused" if self.control.paused else "generating",
            policy_version=2,
            tokens_per_s=5.0,
            groups_published=0,
            prompts_in_flight=0,
            temperature=self.control.sampling.temperature,
            top_p=self.control.sampling.top_p,
            heartbeat_at=time.time(),
        )
        self.telemetry.put_worker(status, ttl_s=1.0)

    def run(self) -> None:
        while not self.stopped.wait(0.05):
            self.control.boundary()
            self.beat()


@pytest.fixture
def service(bus_settings: BusSettings) -> Iterator[tuple[Server, Telemetry]]:
    cfg = ControlSettings(token=TOKEN, command_timeout_s=2.0, heartbeat_s=0.2)
    bus = RedisBus(bus_settings)
    with Server(create_app(cfg, bus_settings)) as server:
        yield server, Telemetry(bus)
    bus.close()


def _auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_token_is_required_to_start(bus_settings: BusSettings, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"SPARKRL_CONTROL__TOKEN or control\.token_file"):
        create_app(ControlSettings(), bus_settings)
    with pytest.raises(ValueError, match="does not exist"):
        create_app(ControlSettings(token_file=str(tmp_path / "nope")), bus_settings)
    (tmp_path / "token").write_text("from-file\n")
    app = create_app(ControlSettings(token_file=str(tmp_path / "token")), bus_settings)
    assert app.title == "sparkrl control"


def test_every_mutating_route_needs_the_token(service: tuple[Server, Telemetry]) -> None:
    server, _ = service
    for method, path, body in MUTATING:
        missing = httpx.request(method, server.url + path, json=body)
        assert missing.status_code == 401, (path, missing.text)
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = httpx.request(method, server.url + path, json=body, headers=_auth("wrong"))
        assert wrong.status_code == 403, (path, wrong.text)
        basic = httpx.request(method, server.url + path, json=body, headers={"Authorization": "Basic eDp5"})
        assert basic.status_code == 401
    # Reads are open unless control.protect_reads.
    assert httpx.get(server.url + "/api/v1/status").status_code == 200


def test_reads_can_be_protected(bus_settings: BusSettings) -> None:
    cfg = ControlSettings(token=TOKEN, protect_reads=True)
    with Server(create_app(cfg, bus_settings)) as server:
        for path in ("/api/v1/status", "/api/v1/workers", "/api/v1/weights", "/api/v1/metrics"):
            assert httpx.get(server.url + path).status_code == 401
            assert httpx.get(server.url + path, headers=_auth()).status_code == 200
        assert httpx.get(server.url + "/healthz").status_code == 200  # probes stay open
        assert httpx.get(server.url + "/").status_code == 200  # the page asks for the token itself


def test_nothing_running_is_a_409_and_nothing_is_sent(service: tuple[Server, Telemetry]) -> None:
    server, telemetry = service
    for method, path, body in MUTATING:
        response = httpx.request(method, server.url + path, json=body, headers=_auth())
        assert response.status_code == 409, (path, response.text)
    assert (
        "no live learner" in httpx.post(server.url + "/api/v1/checkpoint", headers=_auth()).json()["detail"]
    )
    assert telemetry.bus.logs.length("control") == 0
    assert read_control_state(telemetry.bus).paused is False


def test_bad_values_are_a_422_naming_the_field_and_the_bound(service: tuple[Server, Telemetry]) -> None:
    server, _ = service
    patch = httpx.patch(server.url + "/api/v1/hyperparameters", json={"beta": -1, "lr": 0}, headers=_auth())
    assert patch.status_code == 422
    errors = {tuple(e["loc"]): e["msg"] for e in patch.json()["detail"]}
    assert errors.keys() == {("body", "beta"), ("body", "lr")}
    assert errors["body", "beta"].startswith("beta must be ≥ 0: a negative weight would reward what the")
    assert errors["body", "lr"].startswith("lr must be ≥ 1e-10: Adam moves each weight by about lr per step")
    huge = httpx.patch(server.url + "/api/v1/hyperparameters", json={"lr": 1e9}, headers=_auth())
    assert huge.status_code == 422
    [error] = huge.json()["detail"]
    assert error["loc"] == ["body", "lr"] and error["msg"].startswith("lr must be ≤ 0.1: Adam moves every")
    unknown = httpx.patch(server.url + "/api/v1/hyperparameters", json={"learning_rate": 1}, headers=_auth())
    assert unknown.status_code == 422 and unknown.json()["detail"][0]["loc"] == ["body", "learning_rate"]
    empty = httpx.patch(server.url + "/api/v1/hyperparameters", json={}, headers=_auth())
    assert empty.status_code == 422 and "at least one" in empty.text
    # A lone surrogate, echoed back in the error, still makes valid JSON (the default handler's 500).
    body = '{"reason": "\\ud800"}'
    headers = _auth() | {"Content-Type": "application/json"}
    surrogate = httpx.post(server.url + "/api/v1/pause", content=body, headers=headers)
    assert surrogate.status_code in (409, 422)
    json.loads(surrogate.text)
    assert httpx.get(server.url + "/api/v1/weights?limit=0").status_code == 422


def test_commands_reach_the_workers_and_come_back_with_their_outcome(
    service: tuple[Server, Telemetry],
) -> None:
    server, telemetry = service
    workers = [Responder(telemetry, "w0"), Responder(telemetry, "w1")]
    try:
        pause = httpx.post(
            server.url + "/api/v1/pause", json={"reason": "lunch"}, headers=_auth(), timeout=10
        )
        assert pause.status_code == 200, pause.text
        answer = pause.json()
        assert answer["outcome"] == "applied" and answer["command"] == "pause"
        assert [r["target"] for r in answer["results"]] == ["worker:w0", "worker:w1"]
        assert all(w.control.paused for w in workers) and read_control_state(telemetry.bus).paused
        late = Responder(telemetry, "w2")  # a newcomer adopts the fleet's state: it starts paused
        workers.append(late)
        assert late.control.paused

        patch = httpx.patch(
            server.url + "/api/v1/hyperparameters", json={"temperature": 0.7}, headers=_auth()
        )
        assert patch.status_code == 200, patch.text
        assert {r["values"]["temperature"] for r in patch.json()["results"]} == {0.7}
        assert all(w.control.sampling.temperature == 0.7 for w in workers)
        assert all(w.sampling.temperature == 1.0 for w in workers)  # a new value: the old one is whole
        assert read_control_state(telemetry.bus).sampling == {"temperature": 0.7}
        assert httpx.get(server.url + "/api/v1/status").json()["sampling"]["temperature"] == 0.7

        assert httpx.post(server.url + "/api/v1/resume", headers=_auth()).json()["outcome"] == "applied"
        assert not any(w.control.paused for w in workers)
        # The learner's own values need a live learner, even when workers could take the rest.
        mixed = httpx.patch(
            server.url + "/api/v1/hyperparameters", json={"lr": 1e-5, "top_p": 0.9}, headers=_auth()
        )
        assert mixed.status_code == 409 and "no live learner" in mixed.text
    finally:
        for worker in workers:
            worker.stopped.set()


def test_a_silent_target_is_a_504_and_a_vanished_one_is_gone(service: tuple[Server, Telemetry]) -> None:
    server, telemetry = service
    answering = Responder(telemetry, "w0")
    silent = WorkerStatus(
        worker_id="w9",
        engine="torch",
        state="generating",
        tokens_per_s=0.0,
        groups_published=0,
        prompts_in_flight=0,
        heartbeat_at=time.time(),
    )
    telemetry.put_worker(silent, ttl_s=30)  # heartbeats, never answers
    try:
        started = time.monotonic()
        response = httpx.post(server.url + "/api/v1/pause", headers=_auth(), timeout=10)
        assert response.status_code == 504 and time.monotonic() - started >= 2.0
        body = response.json()
        assert body["waiting_for"] == ["worker:w9"] and [r["target"] for r in body["results"]] == [
            "worker:w0"
        ]
        assert "control.command_timeout_s" in body["detail"]
        telemetry.put_worker(silent, ttl_s=0.5)  # now its heartbeat runs out while we wait
        response = httpx.post(server.url + "/api/v1/resume", headers=_auth(), timeout=10)
        assert response.status_code == 200 and response.json()["gone"] == ["worker:w9"]
    finally:
        answering.stopped.set()


def _learner(step: int) -> LearnerStatus:
    return LearnerStatus(
        step=step,
        policy_version=step,
        state="training",
        groups_trained=4 * step,
        group_epoch=1,
        last_loss=-0.01,
        hyperparameters={"loss": "lp_reg", "lr": 1e-4},
        heartbeat_at=time.time(),
    )


def test_the_reads_are_views_over_the_telemetry(service: tuple[Server, Telemetry]) -> None:
    server, telemetry = service
    status = httpx.get(server.url + "/api/v1/status").json()
    assert status["state"] == "unknown" and not status["learner_alive"] and status["step"] == 0
    telemetry.put_learner(_learner(5))
    worker = Responder(telemetry, "w0")
    for step in range(1, 6):
        row = StepMetrics(
            step=step,
            policy_version=step,
            time=1.0,
            metrics={"rollout/reward_mean": 0.1 * step},
            worker_versions={"w0": step - 1},
        )
        telemetry.append(row)
        dropped = {"w7": "heartbeat expired"} if step == 5 else {}
        telemetry.append(
            SyncEvent(
                version=step,
                epoch=1,
                announced_at=1.0,
                outcome="ok",
                bytes=100,
                buckets=1,
                seconds=0.1,
                members=["w0"],
                acknowledged=["w0"],
                dropped=dropped,
            )
        )
    try:
        status = httpx.get(server.url + "/api/v1/status").json()
        assert status["state"] == "training" and status["step"] == 5 and status["last_loss"] == -0.01
        assert status["hyperparameters"] == {"loss": "lp_reg", "lr": 1e-4} and status["workers_live"] == 1
        workers = httpx.get(server.url + "/api/v1/workers").json()
        [view] = workers["workers"]
        assert workers["learner_version"] == 5 and view["lag"] == 3 and view["in_broadcast_group"]
        page = httpx.get(server.url + "/api/v1/weights", params={"limit": 2}).json()
        assert page["total"] == 5 and [e["version"] for e in page["items"]] == [5, 4]
        assert page["items"][0]["dropped"] == {"w7": "heartbeat expired"}
        assert httpx.get(server.url + "/api/v1/evals").json() == {"items": []}
        for version in (0, 5, 10):
            pass_at = {"1": version / 20, "2": 0.9}
            record = dict(
                time=1.0, task="countdown", problems=16, n=2, temperature=1.0, greedy=0.1, seconds=1.0
            )
            telemetry.append(EvalRecord(policy_version=version, pass_at=pass_at, **record))
        evals = httpx.get(server.url + "/api/v1/evals", params={"limit": 2}).json()["items"]
        assert [(e["policy_version"], e["pass_at"]["1"]) for e in evals] == [(5, 0.25), (10, 0.5)]
        rows = httpx.get(server.url + "/api/v1/metrics", params={"since": 3}).json()
        assert [r["step"] for r in rows["rows"]] == [4, 5] and rows["last_step"] == 5
        assert httpx.get(server.url + "/healthz").json() == {"status": "ok", "learner_alive": True}
    finally:
        worker.stopped.set()


def _sse_events(response: httpx.Response, count: int) -> list[tuple[str, str, dict]]:
    events, kind, event_id = [], None, None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            events.append((kind, event_id, json.loads(line[6:])))
            if len(events) == count:
                break
    return events


def test_events_stream_live_and_resume_from_an_id(service: tuple[Server, Telemetry]) -> None:
    server, telemetry = service
    telemetry.append(StepMetrics(step=1, policy_version=1, time=1.0, metrics={}))  # before: not replayed

    def publish() -> None:
        time.sleep(0.5)
        telemetry.append(StepMetrics(step=2, policy_version=2, time=1.0, metrics={}))
        telemetry.append(SyncEvent(version=2, epoch=1, announced_at=1.0, outcome="ok", bytes=1, buckets=1))
        telemetry.append(StepMetrics(step=3, policy_version=3, time=1.0, metrics={}))

    threading.Thread(target=publish, daemon=True).start()
    with httpx.stream("GET", server.url + "/api/v1/events", params={"limit": 3}, timeout=20) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(response, 3)
    # In order within each log (one XREAD over several logs interleaves them by log, not by time).
    assert [d["step"] for k, _, d in events if k == "step"] == [2, 3]
    assert [d["version"] for k, _, d in events if k == "sync"] == [2]
    first_id = next(event_id for kind, event_id, _ in events if kind == "step")
    # Reconnecting with the first event's id replays what came after it.
    headers = {"Last-Event-ID": first_id}
    with httpx.stream(
        "GET", server.url + "/api/v1/events", params={"limit": 2}, headers=headers, timeout=20
    ) as r:
        again = _sse_events(r, 2)
    assert {(k, d.get("step", d.get("version"))) for k, _, d in again} == {("step", 3), ("sync", 2)}
    bad = httpx.get(server.url + "/api/v1/events", params={"cursor": "metrics=oops"})
    assert bad.status_code == 422 and "malformed cursor" in bad.text
    # A stream with a deadline ends by itself.
    quiet = httpx.get(server.url + "/api/v1/events", params={"timeout_s": 0.5}, timeout=10)
    assert quiet.status_code == 200 and quiet.text.startswith("retry:")


# ── schemathesis: the OpenAPI document against the service, no 5xx ────────────────────────────────────


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(service: tuple[Server, Telemetry]) -> None:
    """Every operation of the OpenAPI document, fuzzed (bounded examples), with the right token, a wrong
    one and none: never a 5xx. A stale learner status makes the learner's commands 409, a worker's
    control loop makes the others apply."""
    server, telemetry = service
    telemetry.put_learner(_learner(3).model_copy(update={"heartbeat_at": 1.0}))
    responder = Responder(telemetry, "w0")
    # The event stream never ends by itself; its bounded form is tested above.
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json").exclude(path="/api/v1/events")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10

    seen: Counter[tuple[str, int]] = Counter()

    def no_5xx(case: schemathesis.Case) -> None:
        for headers in (_auth(), _auth("wrong"), {}):
            response = case.call(headers=headers, timeout=30)
            assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.text[:500]}"
            seen[(case.formatted_path, response.status_code)] += 1

    try:
        for operation in operations:
            check = settings(
                max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None
            )(given(case=operation.as_strategy())(no_5xx))
            check()
    finally:
        responder.stopped.set()
    codes = {code for _, code in seen}
    assert {200, 401, 403, 409, 422} <= codes, seen  # it reached the commands, not only the auth wall
    assert sum(seen.values()) >= 3 * len(operations) * 5
