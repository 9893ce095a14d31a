"""Bounded input by default (issue 45, item 4): `rollout.max_prompt_tokens` unset is the model's context
less the completion budget, a value set above that is refused with the fix, and every path a prompt
takes — the feeder (the start file, `sparkrl prompts`) and the worker — bounds its characters before any
tokenizer sees it: a 2 MB prompt is refused by the feeder and, published by anything else, dead-lettered
by the worker with a reason that names the settings."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env

from sparkrl.preflight import check
from sparkrl.proto import ChatMessage, Prompt, decode_message, encode_message
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.feeder import FEED_KIND, feed_prompts
from sparkrl.services.common.prompt_limits import (
    PromptBudgetError,
    PromptLimits,
    context_of,
    feeder_limits,
    resolve_limits,
    resolve_max_prompt_tokens,
)
from sparkrl.services.common.settings import (
    BusSettings,
    PromptFormat,
    RolloutSettings,
    TorchEngineSettings,
    load_settings,
)
from sparkrl.services.common.settings.roles import PromptsConfig, RolloutConfig
from sparkrl.services.rollout import service
from sparkrl.services.rollout.batch import pull_prompts
from sparkrl.services.rollout.engines import make_engine

TWO_MB = "x" * 2_000_000


def _prompt(prompt_id: str, text: str) -> Prompt:
    return Prompt(prompt_id=prompt_id, task="countdown", text=text)


def test_unset_the_budget_is_the_context_less_the_answer_and_a_value_set_above_it_is_refused() -> None:
    assert resolve_max_prompt_tokens(None, 256, 64) == 192
    assert resolve_max_prompt_tokens(100, 256, 64) == 100  # a value set that fits wins
    assert resolve_max_prompt_tokens(100, None, 64) == 100  # the context unknown: only what is set
    assert resolve_max_prompt_tokens(None, None, 64) is None
    with pytest.raises(PromptBudgetError) as over:
        resolve_max_prompt_tokens(300, 256, 64)
    assert "set rollout.max_prompt_tokens to 192 or less" in str(over.value)
    with pytest.raises(PromptBudgetError, match=r"max_new_tokens \(256\) fills the model's context"):
        resolve_max_prompt_tokens(None, 256, 256)


def test_the_context_is_the_engines_cap_else_the_configs() -> None:
    assert context_of({"max_position_embeddings": 4096}) == 4096
    assert context_of({"n_positions": 1024}) == 1024  # GPT-2's name
    assert context_of({"text_config": {"max_position_embeddings": 8192}}) == 8192  # a multimodal model
    assert context_of({"max_position_embeddings": 4096}, max_model_len=2048) == 2048
    assert context_of({}) is None


def test_the_character_bound_drops_or_cuts_before_any_tokenizer() -> None:
    drop = PromptLimits(192, 32, "drop", "the model's context 256 − rollout.sampling.max_new_tokens 64")
    assert drop.max_chars == 192 * 32
    kept, why = drop.screen(_prompt("short", "Use 1 2 to make 3."))
    assert kept is not None and why is None
    gone, why = drop.screen(_prompt("huge", TWO_MB))
    assert gone is None and why == (
        "prompt has 2000000 characters, over rollout.max_prompt_tokens (192, the model's context 256 − "
        "rollout.sampling.max_new_tokens 64) × rollout.max_prompt_chars_per_token (32) = 6144: not tokenized"
    )
    cut = PromptLimits(10, 8, "truncate")
    text, _ = cut.screen(_prompt("t", "a" * 100 + "the question's end"))
    assert text is not None and text.text == ("a" * 100 + "the question's end")[-80:]
    chat = Prompt(
        prompt_id="m",
        task="math",
        messages=[ChatMessage(role="system", content="s" * 50), ChatMessage(role="user", content="u" * 70)],
    )
    messages, _ = cut.screen(chat)
    assert messages is not None and [(m.role, len(m.content)) for m in messages.messages or []] == [
        ("system", 10),
        ("user", 70),
    ]


def test_the_feeder_resolves_the_same_limits_as_the_workers(tiny_model_dir: Path) -> None:  # noqa: F811
    tree = load_settings("smoke", [f"model={tiny_model_dir}", "rollout.sampling.max_new_tokens=64"])
    worker = resolve_limits(RolloutConfig.of(tree).rollout, tiny_model_dir)
    feeder_cfg = PromptsConfig.of(tree)
    feeder = resolve_limits(feeder_cfg.rollout, Path(feeder_cfg.model))
    assert worker == feeder and worker.max_tokens == 256 - 64  # the tiny model's 256 positions
    vllm = RolloutSettings.model_validate(
        {"engine": {"kind": "vllm", "max_model_len": 128}, "sampling": {"max_new_tokens": 64}}
    )
    assert resolve_limits(vllm, tiny_model_dir).max_tokens == 128 - 64  # vLLM's cap, not the config's
    # A feeder given settings that do not fit (a one-off with another tree): the context alone bounds it.
    loose = PromptsConfig.of(
        load_settings(None, [f"model={tiny_model_dir}", "rollout.sampling.max_new_tokens=256"])
    )
    assert feeder_limits(loose.rollout, Path(loose.model)).max_tokens == 256
    capped = load_settings("vllm-cpu", [f"model={tiny_model_dir}", "rollout.engine.max_model_len=128"])
    fed = PromptsConfig.of(capped)
    assert (
        resolve_limits(fed.rollout, Path(fed.model)).max_tokens
        == 128 - capped.rollout.sampling.max_new_tokens
    )


def test_a_value_set_above_the_context_is_a_preflight_problem_and_stops_a_worker(
    tiny_model_dir: Path,  # noqa: F811
    bus_settings: BusSettings,
    tmp_path: Path,
) -> None:
    given = [f"model={tiny_model_dir}", "rollout.sampling.max_new_tokens=64", "rollout.max_prompt_tokens=300"]
    problems = [str(p) for p in check(load_settings("smoke", given))]
    assert any(
        p.startswith("rollout.max_prompt_tokens:") and "set rollout.max_prompt_tokens to 192 or less" in p
        for p in problems
    ), problems
    tree = load_settings("smoke", [*given, f"run_dir={tmp_path}"])
    cfg = RolloutConfig.of(tree.model_copy(update={"bus": bus_settings}))
    with pytest.raises(SystemExit, match=r"set rollout\.max_prompt_tokens to 192 or less"):
        service.build(cfg, threading.Event())  # before the engine is built


def test_the_feeder_refuses_a_huge_prompt_and_cuts_one_with_truncate(bus_settings: BusSettings) -> None:
    prompts = [_prompt("fits", "Use 1 2 to make 3."), _prompt("huge", TWO_MB)]
    with RedisBus(bus_settings) as bus:
        report = feed_prompts(bus, prompts, limits=PromptLimits(100, 32, "drop"))
        assert (report.published, report.refused) == (1, 1)
        (entry,) = bus.read("prompts", "w", 10)
        assert entry.item_id == "fits"
        bus.ack("prompts", [entry.entry_id])
        # Dead-lettered with its reason, once however often the file is fed, its payload not kept.
        feed_prompts(bus, prompts, limits=PromptLimits(100, 32, "drop"))
        (dead,) = bus.dead_letters()
        assert (dead.item_id, dead.entry_id, dead.payload, dead.deliveries) == ("huge", "-", b"", 0)
        assert dead.reason.startswith("refused by the feeder: prompt has 2000000 characters, over")
        report = feed_prompts(bus, prompts, epoch=1, limits=PromptLimits(100, 32, "truncate"))
        assert (report.published, report.refused) == (2, 0)
        entries = bus.read("prompts", "w", 10)
        cut = decode_message(entries[1].payload, Prompt)
        assert cut.prompt_id == "huge@1" and len(cut.text or "") == 3200 and len(entries[1].payload) < 4000


def test_a_huge_prompt_that_reaches_a_worker_is_dead_lettered_untokenized(
    tiny_model_dir: Path,  # noqa: F811
    bus_settings: BusSettings,
) -> None:
    """A producer that skips the feeder's check (another tool, an older build): the worker's own bound
    dead-letters the prompt with the reason, before its tokenizer sees it."""
    engine = make_engine(str(tiny_model_dir), TorchEngineSettings(threads=1))
    limits = resolve_limits(
        RolloutSettings.model_validate({"sampling": {"max_new_tokens": 64}}), tiny_model_dir
    )
    try:
        with RedisBus(bus_settings) as bus:
            for prompt in (_prompt("huge", TWO_MB), _prompt("fits", "Use 1 2 to make 3.")):
                assert bus.publish_prompt(prompt.prompt_id, encode_message(prompt))
            batch = pull_prompts(bus, engine, "w", 10, limits, fmt=PromptFormat())
            assert batch is not None and [p.prompt_id for p in batch.prompts] == ["fits"]
            (dead,) = bus.dead_letters(10)
            assert dead.item_id == "huge" and "prompt has 2000000 characters" in dead.reason
            assert "over rollout.max_prompt_tokens (192, the model's context 256" in dead.reason
            assert "not tokenized" in dead.reason
    finally:
        engine.close()


def test_a_prompts_yaml_written_before_the_limits_still_loads(tmp_path: Path) -> None:
    """A run directory from an earlier build (its prompts.yaml holds bus and prompts only) resumes."""
    old = tmp_path / "prompts.yaml"
    old.write_text(json.dumps({"bus": {"url": "redis://127.0.0.1:1/0"}, "prompts": {"task": "countdown"}}))
    cfg = PromptsConfig.of(load_settings(str(old)))
    assert cfg.rollout.max_prompt_tokens is None and cfg.rollout.overlong == "drop"


def test_the_feeder_command_says_a_bad_file_in_one_line(
    tiny_model_dir: Path,  # noqa: F811
    redis_url: str,
    tmp_path: Path,
) -> None:
    """`sparkrl prompts` (what `sparkrl up` runs as its feeder) on a file whose second row holds a lone
    surrogate: one line naming the file, the line and the fix, exit code 2, no traceback; nothing fed, not
    even the first row, and no feed-done mark left behind."""
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"prompt": "1 + 1?", "answer": "2"}\n{"prompt": "\\udc80?", "answer": "3"}\n')
    given = [f"model={tiny_model_dir}", f"bus.url={redis_url}", f"prompts.path={data}", "prompts.task=math"]
    done = subprocess.run(
        [sys.executable, "-m", "sparkrl.cli", "prompts", *(a for s in given for a in ("--set", s))],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    (line,) = [line for line in done.stderr.splitlines() if "lone surrogate" in line]
    assert f"{data}:2, row 2: field 'prompt' holds a lone surrogate (\\udc80 at character 1)" in line
    assert "remove the escape" in line
    with RedisBus(BusSettings(url=redis_url)) as bus:  # row 1 was fine, and still nothing was fed
        assert bus.pending_info("prompts").lag == 0 and bus.statuses(FEED_KIND) == {}
