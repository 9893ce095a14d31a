"""The tiny countdown model: loadable by the Auto classes, warmed up into the reward window, cached once."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest
from _tiny import tiny_model_dir  # noqa: F401  (pytest fixture)

from sparkrl.services.common import tiny_model
from sparkrl.services.common.modeling import apply_chat_template_if_any, load_model, load_tokenizer
from sparkrl.services.common.settings import SamplingSettings, TorchEngineSettings
from sparkrl.services.common.tasks.countdown import format_prompt, generate_problem, score_countdown
from sparkrl.services.rollout.torch_engine import TorchEngine

REWARD_WINDOW = (0.05, 0.6)


def test_build_info_records_a_reward_in_the_window(tiny_model_dir: Path) -> None:  # noqa: F811
    info = json.loads((tiny_model_dir / tiny_model.BUILD_INFO).read_text())
    assert info["recipe_hash"] == tiny_model.recipe_hash(0)
    assert REWARD_WINDOW[0] <= info["warmup_reward"] <= REWARD_WINDOW[1]
    assert info["sft_steps"] <= tiny_model.RECIPE["max_steps"]


def test_sampled_reward_on_fresh_problems_is_in_the_window(tiny_model_dir: Path) -> None:  # noqa: F811
    engine = TorchEngine(tiny_model_dir, TorchEngineSettings())
    problems = [generate_problem(random.Random(f"fresh-{i}")) for i in range(64)]
    prompts = [apply_chat_template_if_any(engine.tokenizer, format_prompt(p)) for p in problems]
    groups = engine.generate(prompts, SamplingSettings(n=1, temperature=1.0, max_new_tokens=24, seed=123))
    scores = [
        score_countdown(group[0].text, list(p.numbers), p.target)[0]
        for group, p in zip(groups, problems, strict=True)
    ]
    reward = sum(scores) / len(scores)
    assert REWARD_WINDOW[0] <= reward <= REWARD_WINDOW[1], reward


def test_auto_classes_load_it_and_the_tokenizer_is_bytewise(tiny_model_dir: Path) -> None:  # noqa: F811
    tokenizer = load_tokenizer(tiny_model_dir)
    built = tiny_model.build_tokenizer()
    model = load_model(tiny_model_dir)
    assert model.config.vocab_size == len(tokenizer) == len(built) == 260
    for text in ["Use 3 7 to make 21.\n", "(3+4)*5 = 35\n\nwait", "naïve ✓"]:
        ids = tokenizer(text)["input_ids"]
        assert ids == built(text)["input_ids"]  # saved and in-memory tokenizers agree
        assert tokenizer.decode(ids) == text
        assert len(ids) == len(text.encode())  # one token per byte, no BOS
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id == 2
    assert tokenizer.chat_template is None
    assert apply_chat_template_if_any(tokenizer, "1 2") == tokenizer("1 2")["input_ids"]
    assert (
        apply_chat_template_if_any(tokenizer, [{"role": "user", "content": "1"}])
        == tokenizer("1")["input_ids"]
    )


def test_chat_template_is_applied_when_present(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    assert tokenizer.decode(apply_chat_template_if_any(tokenizer, "1+2")) == "[user]1+2[assistant]"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3"}]
    assert (
        tokenizer.decode(apply_chat_template_if_any(tokenizer, messages))
        == "[system]be brief[user]3[assistant]"
    )
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(tmp_path)  # never falls through to a hub download


def test_ensure_reuses_a_current_build(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    def fail(*args: object, **kwargs: object) -> Path:
        raise AssertionError("rebuilt a current model")

    monkeypatch.setattr(tiny_model, "build_tiny_model", fail)
    assert tiny_model.ensure_tiny_model(tiny_model_dir.parent) == tiny_model_dir


def _fake_build(calls: list[int]):
    def build(out_dir: Path, seed: int = 0, recipe: dict = tiny_model.RECIPE) -> Path:
        calls.append(seed)
        (Path(out_dir) / tiny_model.BUILD_INFO).write_text(
            json.dumps({"recipe_hash": tiny_model.recipe_hash(seed, recipe)})
        )
        return Path(out_dir)

    return build


def test_concurrent_callers_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(tiny_model, "build_tiny_model", _fake_build(calls))
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(tiny_model.ensure_tiny_model(tmp_path)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [0]
    assert results == [tmp_path / tiny_model.MODEL_DIRNAME] * 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_a_changed_recipe_rebuilds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(tiny_model, "build_tiny_model", _fake_build(calls))
    first = tiny_model.ensure_tiny_model(tmp_path)
    (first / "stale-file").write_text("from the old recipe")
    monkeypatch.setitem(tiny_model.RECIPE, "version", tiny_model.RECIPE["version"] + 1)
    again = tiny_model.ensure_tiny_model(tmp_path)
    assert again == first and calls == [0, 0]
    assert not (again / "stale-file").exists()
