"""The reward service as a real subprocess over real HTTP: MATH-500, hostile input, 4xx, metrics, shutdown."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _reward import descendants, reward_service, reward_service_process
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
MATH_EVAL = REPO / ".." / "shared" / "data" / "math-eval"
ITEM_TIMEOUT_S = 2.0
MAX_REQUEST_BYTES = 1 << 20
# A pathological request must finish within its item time limit plus this (a kill and a fork).
SLACK_S = 5.0


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    log_dir = tmp_path_factory.mktemp("reward")
    with reward_service(
        log_dir, item_timeout_s=ITEM_TIMEOUT_S, max_request_bytes=MAX_REQUEST_BYTES
    ) as client:
        yield client


def _score(client: httpx.Client, items: list[dict[str, Any]], **extra: Any) -> list[dict[str, Any]]:
    reply = client.post("/score", json={"items": items, **extra})
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert len(results) == len(items)
    return results


def _math500() -> list[dict[str, Any]]:
    path = MATH_EVAL / "math500.jsonl"
    if not path.is_file():
        pytest.skip(f"MATH-500 not found at {path.resolve()} (shared/ must sit beside the repository)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _rate(client: httpx.Client, pairs: list[tuple[str, str]], batches: int = 4) -> float:
    items = [{"task": "math", "completion": completion, "answer": answer} for completion, answer in pairs]
    size = -(-len(items) // batches)
    results = [
        r for i in range(0, len(items), size) for r in _score(client, items[i : i + size], timeout_s=10.0)
    ]
    return sum(r["status"] == "correct" for r in results) / len(results)


@pytest.mark.slow
def test_math500_reference_solutions_verify_against_own_answer_only(service: httpx.Client) -> None:
    rows = _math500()
    started = time.monotonic()
    own = _rate(service, [(row["solution"], row["answer"]) for row in rows])
    own_s = time.monotonic() - started
    # A fixed derangement: every solution meets another problem's answer (equal answers skipped).
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)
    shifted = order[1:] + order[:1]
    pairs = [
        (rows[i]["solution"], rows[j]["answer"])
        for i, j in zip(order, shifted, strict=True)
        if rows[i]["answer"].strip() != rows[j]["answer"].strip()
    ]
    started = time.monotonic()
    other = _rate(service, pairs)
    print(
        f"\nMATH-500: own answer {own:.1%} correct ({len(rows)} items, {own_s:.1f}s); "
        f"other answer {other:.1%} correct ({len(pairs)} items, {time.monotonic() - started:.1f}s)"
    )
    assert own >= 0.99
    assert other <= 0.02


PATHOLOGICAL = {
    "deep_latex": ("\\boxed{" + "\\frac{" * 10_000 + "1}{2}" * 10_000 + "}", "1"),
    "deep_latex_answer": ("\\boxed{1}", "\\frac{" * 10_000 + "1}{2}" * 10_000),
    "answer_100kb": ("\\boxed{1}", "1+" * 50_000),
    "completion_100kb": ("x^{2}+" * 20_000, "1"),
    "braces_unbalanced": ("\\boxed{" + "{" * 100_000, "1"),
    "braces_open": ("{" * 100_000, "1"),
    "slow_sympy": ("\\boxed{9^{9^{9^{9}}}}", "1"),
}


@pytest.mark.parametrize("case", sorted(PATHOLOGICAL))
def test_pathological_input_is_bounded(service: httpx.Client, case: str) -> None:
    completion, answer = PATHOLOGICAL[case]
    started = time.monotonic()
    [result] = _score(service, [{"task": "math", "completion": completion, "answer": answer}])
    assert time.monotonic() - started < ITEM_TIMEOUT_S + SLACK_S
    assert result["status"] in ("timeout", "no_answer", "error", "incorrect"), result
    assert result["score"] == 0.0
    health = service.get("/healthz").json()
    assert health["status"] == "ok" and health["pool"]["alive"] == 2


def test_stuck_item_times_out_without_holding_up_its_batch(service: httpx.Client) -> None:
    items = [
        {"task": "math", "completion": "\\boxed{2}", "answer": "2"},
        {"task": "sleep_forever", "completion": "x"},
        {"task": "math", "completion": "\\boxed{3}", "answer": "4"},
    ]
    started = time.monotonic()
    results = _score(service, items, timeout_s=1.0)
    assert time.monotonic() - started < 1.0 + SLACK_S
    assert [r["status"] for r in results] == ["correct", "timeout", "incorrect"]
    assert results[1]["elapsed_s"] >= 1.0
    assert _score(service, [items[0]])[0]["status"] == "correct"


def test_countdown_items(service: httpx.Client) -> None:
    task_data = {"numbers": [3, 5, 3], "target": 24}
    items = [
        {"task": "countdown", "completion": "(3+5)*3", "task_data": task_data},
        {"task": "countdown", "completion": "3*5+3 = 18", "task_data": task_data},
        {"task": "countdown", "completion": "(5+5)*3-6", "task_data": task_data},
        {"task": "countdown", "completion": "", "task_data": task_data},
        {"task": "countdown", "completion": "(3+5)*3", "task_data": {"numbers": [3, 5, 3]}},
    ]
    results = _score(service, items)
    assert [r["status"] for r in results] == ["correct", "incorrect", "incorrect", "no_answer", "error"]
    assert [r["score"] for r in results] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert "task_data.target" in results[4]["detail"]


def test_countdown_is_scored_in_the_service_while_every_verifier_process_is_busy(
    service: httpx.Client,
) -> None:
    """Countdown's verifier is bounded (verifiers.py, as exact's is): it runs in the service's process,
    without the round trip to a verifier process. With both of the pool's processes held by stuck items,
    countdown items of the same request still come back scored at once, in request order, around the
    pool's."""
    assert service.get("/healthz").json()["inline"] == ["countdown", "exact"]
    task_data = {"numbers": [3, 5, 3], "target": 24}
    items = [
        {"task": "sleep_forever", "completion": "x"},
        {"task": "countdown", "completion": "(3+5)*3", "task_data": task_data},
        {"task": "sleep_forever", "completion": "x"},
        {"task": "countdown", "completion": "3*5+3", "task_data": task_data},
        {"task": "countdown", "completion": "(" * 40 + "3" + ")" * 40, "task_data": task_data},
        {"task": "countdown", "completion": "9" * 20_000, "task_data": task_data},
    ]
    started = time.monotonic()
    results = _score(service, items, timeout_s=2.0)
    assert [r["status"] for r in results] == [
        "timeout",
        "correct",
        "timeout",
        "incorrect",
        "incorrect",
        "incorrect",
    ]
    assert "nested deeper than 32" in results[4]["detail"] and "longer than 256" in results[5]["detail"]
    here = [results[i] for i in (1, 3, 4, 5)]
    assert all(r["elapsed_s"] < 0.5 for r in here), here  # none waited for a verifier process
    assert time.monotonic() - started < 2.0 + SLACK_S
    health = service.get("/healthz").json()
    assert health["pool"]["timeouts"] >= 2 and health["pool"]["alive"] == 2


@pytest.mark.parametrize(
    ("body", "where", "message"),
    [
        (
            {"items": [{"task": "nope", "completion": "x"}]},
            ["body", "items", 0, "task"],
            "unknown task 'nope'",
        ),
        ({"items": [{"task": "math"}]}, ["body", "items", 0, "completion"], "Field required"),
        (
            {"schema_version": 2, "items": [{"task": "math", "completion": "x"}]},
            ["body", "schema_version"],
            "1",
        ),
        ({"items": []}, ["body", "items"], "at least 1 item"),
        (
            {"items": [{"task": "math", "completion": "x", "extra": 1}]},
            ["body", "items", 0, "extra"],
            "Extra",
        ),
    ],
)
def test_bad_requests_get_422_saying_what_is_wrong(
    service: httpx.Client, body: dict[str, Any], where: list[Any], message: str
) -> None:
    reply = service.post("/score", json=body)
    assert reply.status_code == 422, reply.text
    [error] = reply.json()["detail"]
    assert error["loc"] == where
    assert message in error["msg"]
    if where[-1] == "task":
        assert "countdown" in error["msg"] and "math" in error["msg"]


def test_invalid_json_is_422(service: httpx.Client) -> None:
    reply = service.post("/score", content=b'{"items": [', headers={"content-type": "application/json"})
    assert reply.status_code == 422
    assert reply.json()["detail"][0]["type"] == "json_invalid"


def test_oversized_body_is_413(service: httpx.Client) -> None:
    body = json.dumps({"items": [{"task": "math", "completion": "x" * 190_000}] * 6}).encode()
    assert len(body) > MAX_REQUEST_BYTES
    reply = service.post("/score", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 413
    assert f"the limit is {MAX_REQUEST_BYTES} bytes" in reply.json()["detail"]

    # Chunked upload, no Content-Length: counted as it arrives.
    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 65_536):
            yield body[start : start + 65_536]

    reply = service.post("/score", content=chunks(), headers={"content-type": "application/json"})
    assert reply.status_code == 413
    assert service.get("/healthz").status_code == 200


def _samples(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reply = client.get("/metrics")
    assert reply.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(reply.text)
        for sample in family.samples
    }


def test_metrics_count_scored_items(service: httpx.Client) -> None:
    correct = ("sparkrl_reward_items_total", (("status", "correct"), ("task", "math")))
    timeouts = ("sparkrl_reward_timeouts_total", (("task", "sleep_forever"),))
    restarts = ("sparkrl_reward_pool_restarts_total", ())
    before = _samples(service)
    _score(service, [{"task": "math", "completion": "\\boxed{5}", "answer": "5"}] * 3)
    _score(service, [{"task": "sleep_forever", "completion": "x"}], timeout_s=0.5)
    after = _samples(service)
    assert after[correct] == before.get(correct, 0) + 3
    assert after[timeouts] == before.get(timeouts, 0) + 1
    assert after[restarts] == before[restarts] + 1
    assert (
        after[("sparkrl_reward_request_seconds_count", ())]
        == before[("sparkrl_reward_request_seconds_count", ())] + 2
    )
    assert after[("sparkrl_reward_item_seconds_count", (("task", "math"),))] >= 3
    assert after[("sparkrl_reward_pool_alive", ())] == 2


def test_healthz_lists_verifiers_and_pool(service: httpx.Client) -> None:
    health = service.get("/healthz").json()
    assert health["status"] == "ok"
    assert {"math", "countdown", "sleep_forever"} <= set(health["verifiers"])
    assert health["pool"]["processes"] == 2
    assert {"alive", "busy", "queued", "restarts", "timeouts", "crashes"} <= set(health["pool"])


def test_an_item_in_flight_across_a_pause_of_the_whole_service_does_not_time_out(tmp_path: Path) -> None:
    """SIGSTOP of the service and its pool (as `bench/hold_experiment.py` pauses an experiment) for longer
    than an item's limit: on SIGCONT the item goes on and is scored — the pause is not the item's time
    (before, every item in flight across a pause came back `timeout`, a wrong reward)."""
    with reward_service_process(tmp_path, item_timeout_s=3.0) as (client, pid):
        replies: list[httpx.Response] = []
        item = {"task": "sleep_a_second", "completion": "x"}

        def score() -> None:
            replies.append(client.post("/score", json={"items": [item]}))

        sender = threading.Thread(target=score)
        sender.start()
        time.sleep(0.4)  # the item is running: its verifier sleeps a second
        tree = [pid, *descendants(pid)]
        for member in reversed(tree):
            os.kill(member, signal.SIGSTOP)
        time.sleep(4.0)  # past the item's 3 s limit
        for member in tree:
            os.kill(member, signal.SIGCONT)
        sender.join(timeout=60)
        (reply,) = replies
        assert reply.status_code == 200, reply.text
        (result,) = reply.json()["results"]
        assert (result["status"], result["score"]) == ("correct", 1.0), result
        assert result["elapsed_s"] >= 4.0  # wall time, the pause included
