"""Which tokens end a completion (issue 46, part 3): `rollout.eos_tokens` names them exactly, as token
strings or ids; by default the generation config's eos ids plus the tokenizer's EOS. Both engines resolve
the set in one place (`modeling.stop_token_ids`); the torch engine is run on the tiny model, the vLLM
engine's sampling parameters are built from the same set."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from _tiny import tiny_model_dir  # noqa: F401  (pytest fixture)

from sparkrl.services.common.modeling import generation_eos_ids, load_tokenizer, stop_token_ids
from sparkrl.services.common.settings import SamplingSettings, TorchEngineSettings
from sparkrl.services.common.tasks.countdown import format_prompt, generate_problem
from sparkrl.services.rollout.torch_engine import TorchEngine
from sparkrl.services.rollout.vllm_fit import stop_params

EOS, NEWLINE = 2, "Ċ"  # the tiny tokenizer's <eos>, and "\n" as its byte-level vocabulary spells it
SAMPLING = SamplingSettings(n=4, max_new_tokens=24, seed=1)


def prompts(engine: TorchEngine) -> list[list[int]]:
    problems = [generate_problem(random.Random(i)) for i in range(4)]
    return [engine.tokenizer(format_prompt(problem))["input_ids"] for problem in problems]


def test_the_set_is_the_models_own_unless_named(tiny_model_dir: Path) -> None:  # noqa: F811
    tokenizer = load_tokenizer(tiny_model_dir)
    newline = tokenizer.convert_tokens_to_ids(NEWLINE)
    assert generation_eos_ids(tiny_model_dir) == [EOS]
    assert stop_token_ids(tokenizer, [EOS, 9], None) == [EOS, 9]  # the config's list plus the tokenizer's
    assert stop_token_ids(tokenizer, None, None) == [EOS]
    assert stop_token_ids(tokenizer, [EOS, 9], [NEWLINE]) == [newline]  # exactly those named
    assert stop_token_ids(tokenizer, [EOS], ["<eos>", 14, NEWLINE]) == [EOS, newline]
    with pytest.raises(ValueError, match=r"'<\|im_end\|>' is not a token of the tokenizer in .*'<eos>'"):
        stop_token_ids(tokenizer, [EOS], ["<|im_end|>"])
    with pytest.raises(ValueError, match="260 is past the vocabulary"):
        stop_token_ids(tokenizer, [EOS], [260])


def test_the_torch_engine_stops_at_exactly_the_named_tokens(tiny_model_dir: Path) -> None:  # noqa: F811
    settings = TorchEngineSettings(threads=1)
    default = TorchEngine(tiny_model_dir, settings)
    named = TorchEngine(tiny_model_dir, settings, eos_tokens=["<eos>"])
    newline_only = TorchEngine(tiny_model_dir, settings, eos_tokens=[NEWLINE])
    newline = default.tokenizer.convert_tokens_to_ids(NEWLINE)
    try:
        ids = prompts(default)
        made = [c for group in default.generate(ids, SAMPLING) for c in group]
        assert all(c.finish_reason == "stop" and c.token_ids[-1] == EOS for c in made)  # the model's EOS
        same = [c for group in named.generate(ids, SAMPLING) for c in group]
        assert [c.token_ids.tolist() for c in same] == [c.token_ids.tolist() for c in made]
        other = [c for group in newline_only.generate(ids, SAMPLING) for c in group]
        assert any(EOS in c.token_ids.tolist() for c in other)  # <eos> no longer ends a completion
        for c in other:
            tokens = c.token_ids.tolist()
            assert newline not in tokens[:-1]
            assert (c.finish_reason == "stop") == (tokens[-1] == newline)
            assert "\n" not in c.text  # the stop token's text stays out, as vLLM leaves it out
        with pytest.raises(ValueError, match="'<end>' is not a token"):
            TorchEngine(tiny_model_dir, settings, eos_tokens=["<end>"])
    finally:
        for engine in (default, named, newline_only):
            engine.close()


def test_the_vllm_engine_is_given_the_same_set(tiny_model_dir: Path) -> None:  # noqa: F811
    """vLLM stops at the tokenizer's EOS by itself and adds the generation config's ids unless told to
    ignore EOS: the default names the rest, an exact set is named whole with ignore_eos."""
    tokenizer = load_tokenizer(tiny_model_dir)
    newline = tokenizer.convert_tokens_to_ids(NEWLINE)
    assert stop_params(tiny_model_dir, tokenizer, None) == ([], False)  # stops at EOS (2) by itself
    assert stop_params(tiny_model_dir, tokenizer, [NEWLINE]) == ([newline], True)
    assert stop_params(tiny_model_dir, tokenizer, ["<eos>", NEWLINE]) == ([EOS, newline], True)
