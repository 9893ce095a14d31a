"""The tiny model families (tests/_families.py): each builds, loads with its tie, runs a forward pass, and
its tokenizer loads back as built (ids and chat rendering) here and under .venv-vllm's transformers."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _families import (
    FAMILIES,
    build_family,
    build_model,
    build_tokenizer,
    family_dir,  # noqa: F401  (fixture)
)
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

KEYS = list(FAMILIES)
VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
TEXTS = [
    "Using 3, 7 and 25, reach 46.\nAnswer: (25 - 7) * 3 - 8 = 46",
    "  two  spaces,\ttab;\n\nblank line, digits 0123456789 and x^2 + y_1 <= 10.5?",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"}]


def rendered(tokenizer: PreTrainedTokenizerBase, **kwargs: object) -> str:
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **kwargs)
    assert isinstance(text, str)
    return text


def encodings(tokenizer: PreTrainedTokenizerBase) -> dict[str, object]:
    """What must not change between the built tokenizer and a loaded one."""
    prompt = rendered(tokenizer)
    return {
        "texts": [tokenizer(text)["input_ids"] for text in TEXTS],
        "prompt": prompt,
        "prompt_ids": tokenizer(prompt, add_special_tokens=False)["input_ids"],
        "special": [
            tokenizer.bos_token_id,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            tokenizer.unk_token_id,
        ],
        "len": len(tokenizer),
    }


@pytest.mark.parametrize("key", KEYS)
def test_model_loads_with_its_tie_and_runs(key: str, family_dir: Callable[[str], Path]) -> None:  # noqa: F811
    family, model_dir = FAMILIES[key], family_dir(key)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert type(model).__name__ == family.model_class and model.dtype == torch.float32
    V = model.config.vocab_size
    assert V % 64 == 0 and len(tokenizer) <= V
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied == family.tied
    input_ids = torch.tensor([tokenizer(TEXTS[0])["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids).logits
    B, T = input_ids.shape
    assert logits.shape == (B, T, V) and torch.isfinite(logits).all()


@pytest.mark.parametrize("key", KEYS)
def test_tokenizer_loads_as_built_and_round_trips(key: str, family_dir: Callable[[str], Path]) -> None:  # noqa: F811
    family, built = FAMILIES[key], build_tokenizer(FAMILIES[key])
    loaded = AutoTokenizer.from_pretrained(family_dir(key))
    assert encodings(loaded) == encodings(built)
    for text in TEXTS:
        ids = loaded(text)["input_ids"]
        assert loaded.decode(ids, skip_special_tokens=True) == text
        # One token per ASCII character, after the BOS where the family prepends one.
        assert len(ids) == len(text) + family.add_bos
        assert (ids[0] == loaded.bos_token_id) == family.add_bos


@pytest.mark.parametrize("key", KEYS)
def test_chat_template_ends_as_the_family_does(key: str, family_dir: Callable[[str], Path]) -> None:  # noqa: F811
    family, tokenizer = FAMILIES[key], AutoTokenizer.from_pretrained(family_dir(key))
    prompt = rendered(tokenizer)
    assert prompt.endswith(family.prompt_end) and "What is 12 + 30?" in prompt and "Be brief." in prompt
    writes_bos = "{{ bos_token }}" in family.chat_template
    assert writes_bos == (family.bos is not None and prompt.startswith(family.bos))
    # The template writes the BOS: tokenized as a chat it appears once.
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if family.bos is not None:
        assert ids.count(tokenizer.bos_token_id) == prompt.count(family.bos)
    answered = [*CHAT, {"role": "assistant", "content": "42"}]
    closed = tokenizer.apply_chat_template(answered, tokenize=False)
    assert "42" in closed and not closed.endswith(family.prompt_end)


def test_qwen3_thinking_switch(family_dir: Callable[[str], Path]) -> None:  # noqa: F811
    for key in ("qwen3", "qwen3_moe"):
        tokenizer = AutoTokenizer.from_pretrained(family_dir(key))
        thinking, plain = (
            rendered(tokenizer, enable_thinking=True),
            rendered(tokenizer, enable_thinking=False),
        )
        assert rendered(tokenizer) == thinking != plain
        assert plain == thinking + "<think>\n\n</think>\n\n"
        # <think> is one added token that decoding keeps (it is not special).
        ids = tokenizer(plain, add_special_tokens=False)["input_ids"]
        assert tokenizer.convert_tokens_to_ids("<think>") in ids
        assert tokenizer.decode(ids, skip_special_tokens=True).endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("key", KEYS)
def test_generation_config_stops_at_the_family_eos(key: str, family_dir: Callable[[str], Path]) -> None:  # noqa: F811
    family, model_dir = FAMILIES[key], family_dir(key)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    stop = tokenizer.convert_tokens_to_ids(list(family.stop))
    assert (eos if isinstance(eos, list) else [eos]) == stop
    assert tokenizer.eos_token_id in stop
    assert (tokenizer.pad_token, tokenizer.bos_token) == (family.pad, family.bos)


def test_llama_has_no_pad_and_two_eos(family_dir: Callable[[str], Path]) -> None:  # noqa: F811
    model_dir = family_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.pad_token is None and tokenizer.pad_token_id is None
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    assert eos == tokenizer.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
    assert json.loads((model_dir / "config.json").read_text())["pad_token_id"] is None


def test_builds_are_seeded_and_reused(tmp_path: Path) -> None:
    family = FAMILIES["qwen3_moe"]
    tokenizer = build_tokenizer(family)
    first, again = build_model(family, tokenizer, seed=3), build_model(family, tokenizer, seed=3)
    for (name, a), b in zip(first.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    model_dir = build_family("olmo2", tmp_path)
    written = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert build_family("olmo2", tmp_path) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == written


# Runs under .venv-vllm's transformers (5.19): what vLLM's workers will see of the same directories.
VLLM_SIDE = """
import json, sys
from transformers import AutoTokenizer
texts, chat, dirs = json.loads(sys.stdin.read())
out = {}
for key, path in dirs.items():
    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    out[key] = {
        "texts": [tok(text)["input_ids"] for text in texts],
        "prompt": prompt,
        "prompt_ids": tok(prompt, add_special_tokens=False)["input_ids"],
        "special": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id],
        "len": len(tok),
    }
print(json.dumps(out))
"""


def test_tokenizers_load_as_built_under_vllms_transformers(family_dir: Callable[[str], Path]) -> None:  # noqa: F811
    if not VLLM_PYTHON.exists():
        message = "no .venv-vllm: `make vllm-env` builds it"
        if os.environ.get("SPARKRL_REQUIRE_VLLM"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    dirs = {key: str(family_dir(key)) for key in KEYS}
    result = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_SIDE],
        input=json.dumps([TEXTS, CHAT, dirs]),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    for key in KEYS:
        assert seen[key] == json.loads(json.dumps(encodings(build_tokenizer(FAMILIES[key])))), key
