"""When prompt + answer overflow the model's context, the preflight says which budget to change and what
happens to the prompts that stay too long (issue 23, item 5): lowering max_new_tokens is offered only where
it helps; a prompt longer than the whole context gets a prompt budget with `rollout.overlong`, or a longer
model."""

from __future__ import annotations

import json
from pathlib import Path

from _tiny import tiny_model_dir  # noqa: F401  (fixture)

from sparkrl.preflight import check
from sparkrl.services.common.settings import load_settings


def _problems(model: Path, data: Path | None, *overrides: str) -> list[str]:
    given = [f"model={model}", *overrides]
    if data is not None:
        given += [f"prompts.path={data}", "prompts.task=math"]
    return [f"{p.setting}: {p.message}" for p in check(load_settings("demo", given))]


def _dataset(tmp_path: Path, words: int) -> Path:
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": "short question?", "answer": "1"}, {"prompt": "long " * words + "?", "answer": "2"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_an_answer_budget_that_fills_the_context_is_named_with_a_value(tiny_model_dir: Path) -> None:  # noqa: F811
    (problem,) = _problems(tiny_model_dir, None, "rollout.sampling.max_new_tokens=256")
    assert "lower rollout.sampling.max_new_tokens to" in problem


def test_a_prompt_longer_than_the_context_gets_a_prompt_budget(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    data = _dataset(tmp_path, 400)  # far past the tiny model's 256 positions
    (problem,) = _problems(tiny_model_dir, data, "rollout.sampling.max_new_tokens=32")
    assert "rollout.max_prompt_tokens=224 with rollout.overlong=drop" in problem
    assert "rollout.overlong=truncate (their last 224 tokens are kept)" in problem
    assert "a model with a longer context" in problem and "max_new_tokens to" not in problem
    (both,) = _problems(tiny_model_dir, data, "rollout.sampling.max_new_tokens=250")
    assert "lower rollout.sampling.max_new_tokens (e.g. to 64): alone it fills the context" in both
    assert "rollout.max_prompt_tokens=192" in both
    fixed = ["rollout.sampling.max_new_tokens=32", "rollout.max_prompt_tokens=224", "rollout.overlong=drop"]
    assert _problems(tiny_model_dir, data, *fixed) == []  # the advice, followed, passes


def test_where_a_smaller_answer_budget_is_enough_it_is_the_advice(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    data = _dataset(tmp_path, 40)
    (problem,) = _problems(tiny_model_dir, data, "rollout.sampling.max_new_tokens=240")
    assert (
        "lower rollout.sampling.max_new_tokens to 55 or less" in problem
        and "max_prompt_tokens" not in problem
    )
