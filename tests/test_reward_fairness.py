"""The reward service under abuse, over real HTTP: one client's flood does not starve another, the
server's budgets bound every request whatever the client asks, a client that goes away stops its work,
and schemathesis (surrogates, huge numbers included) never gets a 5xx."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from _reward import reward_service
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HOSTILE = {"task": "math", "completion": "\\boxed{9^{9^{9^{9}}}}", "answer": "1"}  # sympy for seconds
STUCK = {"task": "sleep_forever", "completion": "x"}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    log_dir = tmp_path_factory.mktemp("reward")
    with reward_service(
        log_dir, item_timeout_s=5.0, max_item_timeout_s=6.0, max_request_seconds=8.0
    ) as client:
        yield client


def _pool(client: httpx.Client) -> dict[str, int]:
    return client.get("/healthz").json()["pool"]


def _idle(client: httpx.Client, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while _pool(client)["busy"] or _pool(client)["queued"]:
        assert time.monotonic() < deadline, f"the pool stayed busy: {_pool(client)}"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_flood_does_not_starve_a_one_item_request(service: httpx.Client) -> None:
    flood_answer: list[httpx.Response] = []

    def flood() -> None:
        flood_answer.append(service.post("/score", json={"items": [HOSTILE] * 40}, timeout=60))

    flooding = threading.Thread(target=flood)
    flooding.start()
    deadline = time.monotonic() + 10
    while _pool(service)["busy"] < 2:  # both processes are working on the flood
        assert time.monotonic() < deadline
        time.sleep(0.05)
    started = time.monotonic()
    reply = service.post(
        "/score", json={"items": [{"task": "math", "completion": "\\boxed{2}", "answer": "2"}]}
    )
    took = time.monotonic() - started
    assert reply.status_code == 200 and reply.json()["results"][0]["status"] == "correct"
    assert took < 2.0, f"a one-item request waited {took:.1f}s behind another client's flood"
    flooding.join(60)
    # The flood itself is bounded by the server's request budget (8 s), not by its 40 × 5 s of work.
    assert flood_answer[0].status_code == 200
    statuses = [r["status"] for r in flood_answer[0].json()["results"]]
    assert set(statuses) <= {"timeout", "no_answer", "incorrect", "error"}
    _idle(service)


@pytest.mark.slow
def test_the_server_caps_what_a_client_asks_for(service: httpx.Client) -> None:
    started = time.monotonic()
    reply = service.post("/score", json={"items": [STUCK], "timeout_s": 600})
    [result] = reply.json()["results"]
    assert result["status"] == "timeout" and "6s limit" in result["detail"]  # reward.max_item_timeout_s
    assert time.monotonic() - started < 6.0 + 4.0
    started = time.monotonic()
    reply = service.post("/score", json={"items": [STUCK] * 6, "timeout_s": 5})
    assert time.monotonic() - started < 8.0 + 4.0  # reward.max_request_seconds, not 3 rounds × 5 s
    details = [r["detail"] for r in reply.json()["results"]]
    assert any("budget was spent" in d for d in details), details
    _idle(service)


def test_a_client_that_goes_away_stops_its_work(service: httpx.Client) -> None:
    before = _metric(service, "sparkrl_reward_requests_cancelled_total")

    async def hang_up() -> None:
        async with httpx.AsyncClient(base_url=str(service.base_url)) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/score", json={"items": [STUCK] * 8}, timeout=1.0)

    asyncio.run(hang_up())
    _idle(service, timeout_s=5)  # not the 8 s budget: the work stopped with the client
    assert _metric(service, "sparkrl_reward_requests_cancelled_total") == before + 1


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_every_bad_body_is_a_422_even_with_lone_surrogates(service: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    for body in (
        '{"items": "\\ud800"}',
        '{"items": [{"task": "\\ud800", "completion": "x"}]}',
        '{"items": [{"task": "math", "completion": "x", "\\udfff": 1}]}',
        '{"items": [{"task": "math", "completion": "x"}], "timeout_s": 1e309}',
        '{"items": [{"task": "math", "completion": "x"}], "timeout_s": -1}',
    ):
        reply = service.post("/score", content=body.encode(), headers=headers)
        assert reply.status_code == 422, (body, reply.text)
        json.loads(reply.text)
    # A surrogate is not text: the error names the field.
    body = '{"items": [{"task": "math", "completion": "\\\\boxed{\\ud800}", "answer": "1"}]}'
    reply = service.post("/score", content=body.encode(), headers=headers)
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"] == ["body", "items", 0, "completion"]


def test_schemathesis_finds_no_server_error(service: httpx.Client) -> None:
    schema = schemathesis.openapi.from_url(str(service.base_url.join("/openapi.json")))
    [operation] = [r.ok() for r in schema.get_all_operations() if r.ok().path == "/score"]
    huge = st.sampled_from(["\ud800", "\udfff" * 10, "9" * 400, "\\boxed{" + "9^" * 50 + "9}", "x"])

    @given(case=operation.as_strategy(), text=huge, number=st.sampled_from([1e308, -1e308, 10**40, 0]))
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def no_5xx(case: schemathesis.Case, text: str, number: float) -> None:
        response = case.call(timeout=60)
        assert response.status_code < 500, response.text[:500]
        # The same operation with hostile values spliced in.
        item = {
            "task": "countdown",
            "completion": text,
            "task_data": {"numbers": [number, 3], "target": number},
        }
        body = json.dumps({"items": [item], "timeout_s": 1})  # ASCII-escaped: surrogates travel as \\udXXX
        hostile = service.post("/score", content=body.encode(), headers={"content-type": "application/json"})
        assert hostile.status_code < 500, hostile.text[:500]

    no_5xx()
    _idle(service)
