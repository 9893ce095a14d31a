"""services/reward/judge.py against a real HTTP endpoint that answers as an OpenAI-compatible server does
— and as one fails: down, slower than the deadline, garbage, 429 then an answer, a refusal. Every failure is
a named status with its reason, never a silent 0 that trains as "wrong"; a reply is parsed (a number on the
rubric's scale, labels, a boxed grade) or `unparseable`; the same item is judged once; the key is sent
and never shown. (These test the client; tests/test_judge_stack.py runs a real `vllm serve` as the judge.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _endpoints import Endpoint

from sparkrl.proto.reward import RewardItem
from sparkrl.services.common.settings.reward import JudgeSettings
from sparkrl.services.reward.judge import Judge, JudgeKeyError, fill_rubric, parse_reply

KEY = "sk-test-0123456789abcdef"


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    served = Endpoint()
    yield served
    served.server.shutdown()


def item(completion: str = "42", question: str = "What is 6 * 7?") -> RewardItem:
    return RewardItem(task="judge", completion=completion, answer="42", task_data={"question": question})


def judge(url: str, **settings: Any) -> Judge:
    base = {"url": url, "deadline_s": 5.0, "backoff_s": 0.05, "api_key_env": "JUDGE_TEST_KEY"}
    return Judge(JudgeSettings(**(base | settings)))


def test_a_grade_is_scored_and_the_reply_kept(endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    endpoint.plan = [(200, "The answer matches. Grade: 10", 0.0), (200, "Partly. 4", 0.0)]
    scorer = judge(endpoint.url, pass_score=0.8, concurrency=1)  # the plan's answers in the items' order
    try:
        results = scorer.score([item("42"), item("40")])
    finally:
        scorer.close()
    assert [(r.status, r.score) for r in results] == [("correct", 1.0), ("incorrect", 0.4)]
    assert results[0].detail == "judge: The answer matches. Grade: 10"
    sent = endpoint.requests[0]
    assert sent["path"] == "/v1/chat/completions" and sent["auth"] == f"Bearer {KEY}"
    assert "What is 6 * 7?" in sent["body"]["messages"][0]["content"] and sent["body"]["model"] == "judge"
    assert all(KEY not in r.detail for r in results)


def test_the_same_item_is_judged_once(endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    scorer = judge(endpoint.url)
    try:
        first, spent = scorer.judge([item("42"), item("41")])
        again, spent_again = scorer.judge([item("42"), item("41"), item("42")])
    finally:
        scorer.close()
    assert len(endpoint.requests) == 2
    assert [r.status for r in again] == [first[0].status, first[1].status, first[0].status]
    # What each batch spent, and in all (Prometheus reads the sum): the second cost no call.
    assert (spent.calls, spent.cache_hits, spent.tokens, spent.items) == (2, 0, 50, {"correct": 2})
    assert (spent_again.calls, spent_again.cache_hits, spent_again.tokens) == (0, 3, 0)
    total = scorer.snapshot()
    assert (total.calls, total.cache_hits, total.items) == (2, 3, {"correct": 5})


@pytest.mark.parametrize(
    ("plan", "status", "says"),
    [
        ([(200, b"<html>not json</html>", 0.0)], "unparseable", "not a chat completion"),
        ([(200, "I cannot grade this.", 0.0)], "unparseable", "no score in the judge's reply"),
        ([(200, "Grade: 11", 0.0)], "unparseable", "no score"),  # off the scale
        ([(429, {"error": "slow down"}, 0.0), (200, "8", 0.0)], "incorrect", "judge: 8"),  # retried
        ([(503, "busy", 0.0)] * 4, "error", "after 3 retries: HTTP 503"),
        ([(400, "bad request", 0.0)], "error", "the judge refused the request: HTTP 400"),
        ([(200, "10", 3.0)], "timeout", "past reward.judge.deadline_s (1s)"),
    ],
)
def test_every_failure_is_a_named_status_with_its_reason(
    endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch, plan: list[Any], status: str, says: str
) -> None:
    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    endpoint.plan = list(plan)
    scorer = judge(endpoint.url, deadline_s=1.0)
    try:
        (result,) = scorer.score([item()])
    finally:
        scorer.close()
    assert result.status == status and says in result.detail, result
    assert result.score == (0.8 if status == "incorrect" else 0.0)
    assert result.elapsed_s < 3.0  # the deadline holds, a slow judge included


def test_a_judge_that_is_down_is_an_error_not_a_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    scorer = judge("http://127.0.0.1:9/v1", retries=1)  # discard port: nothing listens
    try:
        (result,) = scorer.score([item()])
    finally:
        scorer.close()
    assert result.status == "error" and "ConnectError" in result.detail and result.score == 0.0


def test_replies_parse_as_numbers_labels_or_a_boxed_grade() -> None:
    numbers = JudgeSettings(url="http://x/v1", score_range=(1, 5))
    assert parse_reply("Between 2 and 3, I give 4", numbers) == 0.75
    assert parse_reply("no digits", numbers) is None and parse_reply("0", numbers) is None
    labels = JudgeSettings(url="http://x/v1", parse="labels", labels={"correct": 1.0, "incorrect": 0.0})
    assert parse_reply("INCORRECT: the sign is wrong, not correct", labels) == 0.0  # the first named
    assert parse_reply("Correct.", labels) == 1.0 and parse_reply("maybe", labels) is None
    boxed = JudgeSettings(url="http://x/v1", parse="boxed", labels={"yes": 1.0, "no": 0.0})
    assert parse_reply(r"Reasoning 3... \boxed{7}", boxed) == 0.7 and parse_reply(r"\boxed{no}", boxed) == 0.0
    assert parse_reply("7", boxed) is None
    with pytest.raises(ValueError, match="low end must be below"):
        JudgeSettings(url="http://x/v1", score_range=(5, 5))


def test_the_rubric_is_filled_by_replacement_and_the_key_read_safely(tmp_path: Path) -> None:
    filled = fill_rubric("Q {question} R {reference} A {completion}", item("{reference} {0} }{"))
    assert filled == "Q What is 6 * 7? R 42 A {reference} {0} }{"
    missing = JudgeSettings(url="http://x/v1", api_key_env="JUDGE_KEY_NOT_SET")
    with pytest.raises(JudgeKeyError, match="JUDGE_KEY_NOT_SET, which is not set"):
        Judge(missing)
    secret = tmp_path / "key"
    secret.write_text(KEY + "\n")
    scorer = Judge(JudgeSettings(url="http://x/v1", api_key_file=str(secret)))
    try:
        assert scorer.http.headers["Authorization"] == f"Bearer {KEY}"
        assert KEY not in repr(scorer.settings) and KEY not in scorer.settings.model_dump_json()
    finally:
        scorer.close()


def test_the_reward_service_sends_judge_items_to_the_judge(
    endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`reward.judge.url` set: the service scores `task: judge` items through the judge (its threads,
    beside the verifier pool), the others as before; the key is in no log line and no answer."""
    from _reward import reward_service

    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    endpoint.plan = [(200, "Grade: 10", 0.0), (200, "no idea", 0.0)]
    settings = JudgeSettings(url=endpoint.url, api_key_env="JUDGE_TEST_KEY", backoff_s=0.05, concurrency=1)
    countdown = RewardItem(task="countdown", completion="3*7", task_data={"numbers": [3, 7], "target": 21})
    with reward_service(tmp_path, judge=settings) as client:
        health = client.get("/healthz").json()
        answer = client.post(
            "/score", json={"items": [i.model_dump() for i in (item("42"), countdown, item("41"))]}
        )
        scraped = client.get("/metrics").text
    assert "judge" in health["verifiers"] and KEY not in json.dumps(health)
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert [r["status"] for r in results] == ["correct", "correct", "unparseable"]
    assert results[2]["detail"] == "no score in the judge's reply: no idea"
    assert all(r["auth"] == f"Bearer {KEY}" for r in endpoint.requests) and len(endpoint.requests) == 2
    assert KEY not in (tmp_path / "service.log").read_text() and KEY not in answer.text
    spent = answer.json()["judge"]  # what the worker sums for the page
    assert {k: spent[k] for k in ("items", "calls", "cache_hits", "tokens")} == {
        "items": {"correct": 1, "unparseable": 1}, "calls": 2, "cache_hits": 0, "tokens": 50,
    }  # fmt: skip
    for line in [
        "sparkrl_reward_judge_calls_total 2.0",
        "sparkrl_reward_judge_tokens_total 50.0",  # 25 a reply, as the endpoint reported
        'sparkrl_reward_judge_items_total{status="unparseable"} 1.0',
        'sparkrl_reward_judge_items_total{status="timeout"} 0.0',  # every failure's series from the start
        'sparkrl_reward_items_total{status="unparseable",task="judge"} 1.0',
    ]:
        assert line in scraped, scraped
