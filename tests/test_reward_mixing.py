"""Rewards beyond one verifier (issue 49): tasks that mix verifiers (`reward.mixes`), a reward model the
service runs itself (`reward.model`, a sequence classifier built here), and what a failed score becomes
in a group (neutral, never a 0 that trains as "wrong") — through the real reward service over HTTP, its
judge a real HTTP endpoint."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from _endpoints import Endpoint

from sparkrl.proto.reward import RewardItem, RewardResult
from sparkrl.services.common.settings import load_settings
from sparkrl.services.common.settings.reward import JudgeSettings, MixSettings, RewardModelSettings
from sparkrl.services.reward.mixing import combine
from sparkrl.services.rollout.batch import group_rewards

MIXES = {
    "exact_and_judge": {
        "combine": "weighted",
        "parts": [{"verifier": "exact", "weight": 3}, {"verifier": "judge"}],
    },
    "math_else_judge": {"combine": "fallback", "parts": [{"verifier": "math"}, {"verifier": "judge"}]},
}


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    served = Endpoint()
    yield served
    served.server.shutdown()


def _item(task: str, completion: str, answer: str | None = "42") -> dict[str, object]:
    return RewardItem(
        task=task, completion=completion, answer=answer, task_data={"question": "6*7?"}
    ).model_dump()


def test_mixed_tasks_weigh_their_parts_and_fall_back_to_the_judge_only_where_needed(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    from _reward import reward_service

    judge = JudgeSettings(url=endpoint.url, backoff_s=0.05, retries=1, deadline_s=5, concurrency=1)
    mixes = {name: MixSettings.model_validate(mix) for name, mix in MIXES.items()}
    # In the order asked: the weighted items' judge parts at once, then the fallback's second round.
    endpoint.plan = [(200, "Grade: 5", 0.0), (200, "no grade", 0.0), (200, "Grade: 10", 0.0)]
    items = [
        _item("exact_and_judge", "42"),  # exact 1 (×3), the judge 0.5: 0.875, below the pass score 1
        _item("math_else_judge", "I cannot say"),  # math finds no \boxed{}: the judge decides (10)
        _item("math_else_judge", "\\boxed{42}"),  # math decides: the judge is not asked
        _item("exact_and_judge", "41"),  # the judge's reply has no grade: the item is unparseable
    ]
    with reward_service(tmp_path, judge=judge, mixes=mixes) as client:
        health = client.get("/healthz").json()
        answer = client.post("/score", json={"items": items}).json()
    results = answer["results"]
    assert {"exact_and_judge", "math_else_judge", "judge"} <= set(health["verifiers"])
    assert [r["status"] for r in results] == ["incorrect", "correct", "correct", "unparseable"]
    assert results[0]["score"] == pytest.approx(0.875)
    assert results[0]["detail"].startswith("exact: correct 1; judge: incorrect 0.5 — ")
    assert "Grade: 5" in results[0]["detail"]  # the judge's reply, kept
    assert results[1]["detail"].startswith("math: no_answer 0; judge: correct 1")
    assert results[2]["detail"].startswith("math: correct 1") and "judge" not in results[2]["detail"]
    assert results[3]["score"] == 0 and "judge unparseable" in results[3]["detail"]
    assert len(endpoint.requests) == 3  # the weighted items' two and the one fallback
    # What the judge spent on its parts, over both rounds: the page's LLM judge panel sums these.
    assert answer["judge"]["items"] == {"incorrect": 1, "unparseable": 1, "correct": 1}
    assert answer["judge"]["calls"] == 3


def test_a_mix_of_parts_the_service_does_not_score_stops_it_naming_them(tmp_path: Path) -> None:
    from sparkrl.services.common.settings import RewardSettings
    from sparkrl.services.reward.app import create_app

    mixes = {"judged": MixSettings.model_validate({"parts": [{"verifier": "math"}, {"verifier": "judge"}]})}
    with pytest.raises(ValueError, match=r"part 'judge' is not scored here .*reward\.judge\.url"):
        create_app(RewardSettings(mixes=mixes))
    with pytest.raises(ValueError, match="names a verifier twice"):
        MixSettings.model_validate({"parts": [{"verifier": "math"}, {"verifier": "math"}]})


def test_a_weighted_mix_is_no_answer_only_when_no_part_found_one() -> None:
    mix = MixSettings.model_validate(MIXES["exact_and_judge"])
    nothing = RewardResult(score=0.0, status="no_answer", elapsed_s=0.1)
    assert combine(mix, [nothing, nothing]).status == "no_answer"
    wrong = RewardResult(score=0.0, status="incorrect", elapsed_s=0.1)
    assert combine(mix, [nothing, wrong]).status == "incorrect"
    timed_out = RewardResult(score=0.0, status="timeout", detail="past 5s", elapsed_s=5.0)
    failed = combine(mix, [RewardResult(score=1.0, status="correct", elapsed_s=0.1), timed_out])
    assert (failed.status, failed.score) == ("timeout", 0.0) and "judge timeout: past 5s" in failed.detail


def test_a_failed_score_is_neutral_in_its_group_never_a_zero() -> None:
    def said(status: str, score: float) -> RewardResult:
        return RewardResult(score=score, status=status, elapsed_s=0.0)  # type: ignore[arg-type]

    details = [said("correct", 1.0), said("incorrect", 0.0), said("timeout", 0.0), said("unparseable", 0.0)]
    rewards = group_rewards(details, [0.0, -0.5, 0.0, 0.0])
    assert rewards == [1.0, -0.5, 0.25, 0.25]  # the scored ones' mean: advantage 0, the group's mean kept
    assert group_rewards([said("error", 0.0)] * 3, [0.0] * 3) == [0.0] * 3  # no signal at all


def _tiny_classifier(out: Path, labels: int = 1) -> Path:
    """A sequence classifier in Hugging Face format, built here (random weights: its scores are noise)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from sparkrl.services.common.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_labels=labels, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    Qwen2ForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_the_reward_service_scores_with_a_reward_model_in_batches(tmp_path: Path) -> None:
    from _reward import reward_service

    from sparkrl.services.reward.reward_model import RewardModel

    path = _tiny_classifier(tmp_path / "rm")
    settings = RewardModelSettings(path=str(path), batch_size=2)
    items = [_item("reward_model", text) for text in ("42", "41", "forty-two", "6*7=42", "")]
    alone = RewardModel(settings).score([RewardItem.model_validate(i) for i in items])
    one_by_one = RewardModel(settings.model_copy(update={"batch_size": 1}))
    singles = [one_by_one.score([RewardItem.model_validate(i)])[0] for i in items]
    with reward_service(tmp_path, model=settings) as client:
        results = client.post("/score", json={"items": items}).json()["results"]
    assert [r["score"] for r in results] == pytest.approx([r.score for r in alone], abs=1e-6)
    assert [r.score for r in singles] == pytest.approx([r.score for r in alone], abs=1e-5)  # padding
    assert all(0 < r["score"] < 1 and r["status"] in ("correct", "incorrect") for r in results)
    assert len({round(r["score"], 6) for r in results}) > 1  # it reads the completion
    assert "reward model: " in results[0]["detail"]


def test_preflight_names_a_task_nothing_scores_and_a_missing_reward_model(tmp_path: Path) -> None:
    from sparkrl.reward_check import problems

    data = tmp_path / "questions.jsonl"
    data.write_text(json.dumps({"prompt": "Write a haiku."}) + "\n")
    judged = load_settings("smoke", [f"prompts.path={data}", "prompts.task=judge"])
    assert [s for s, _ in problems(judged)] == ["prompts.task"]
    assert "set reward.judge.url" in problems(judged)[0][1]
    served = judged.model_copy(update={"reward": judged.reward.model_copy(deep=True)})
    served.reward.judge.url = "http://127.0.0.1:9/v1"
    assert problems(served) == []
    missing = load_settings(
        "smoke", [f"prompts.path={data}", "prompts.task=reward_model", "reward.model.path=/no"]
    )
    assert [s for s, _ in problems(missing)] == ["reward.model.path"]


def test_a_file_of_open_questions_feeds_the_judge_its_question(tmp_path: Path) -> None:
    from sparkrl.services.common.tasks.datasets import iter_prompts

    data = tmp_path / "questions.jsonl"
    data.write_text(
        json.dumps({"prompt": "Write a haiku."}) + "\n" + json.dumps({"prompt": "2+2?", "answer": 4}) + "\n"
    )
    cfg = load_settings(
        "smoke", [f"prompts.path={data}", "prompts.task=judge", "prompts.template=Q: {prompt}"]
    )
    prompts = list(iter_prompts(cfg.prompts))
    assert [(p.text, p.answer, p.task_data) for p in prompts] == [
        ("Q: Write a haiku.", None, {"question": "Write a haiku."}),
        ("Q: 2+2?", "4", {"question": "2+2?"}),
    ]
