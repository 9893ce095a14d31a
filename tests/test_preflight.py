"""`sparkrl check` and `sparkrl up`'s preflight: what would fail later is one line naming the setting and
the fix, exit 2, before anything is spawned (issue 12, items 6 and 7)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env

from sparkrl.preflight import Problem, check
from sparkrl.services.common.settings import SparkSettings, load_settings

ROOT = Path(__file__).resolve().parents[1]
MATH500 = ROOT.parent / "shared" / "data" / "math-eval" / "math500.jsonl"


def _settings(model: Path, *overrides: str) -> SparkSettings:
    return load_settings("demo", [f"model={model}", *overrides])


def _named(problems: list[Problem]) -> list[str]:
    return [p.setting for p in problems]


def test_the_demo_passes(tiny_model_dir: Path) -> None:  # noqa: F811
    assert check(_settings(tiny_model_dir)) == []


def test_each_problem_names_its_setting(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    missing = check(_settings(tmp_path / "nope"))
    assert _named(missing) == ["model"] and "nope does not exist" in missing[0].message
    long = check(_settings(tiny_model_dir, "rollout.sampling.max_new_tokens=300"))
    assert _named(long) == ["rollout.sampling.max_new_tokens"] and "context (256)" in long[0].message
    topk = check(_settings(tiny_model_dir, "rollout.sampling.topk_logprobs=1000"))
    assert _named(topk) == ["rollout.sampling.topk_logprobs"]
    if MATH500.is_file():  # shared/ beside the checkout
        math = ["prompts.task=math", f"prompts.path={MATH500}"]
        fields = check(_settings(tiny_model_dir, *math, "prompts.prompt_field=question"))
        assert _named(fields) == ["prompts.prompt_field / prompts.answer_field"]
        assert "no field 'question'" in fields[0].message
    gone = check(_settings(tiny_model_dir, "prompts.task=math", f"prompts.path={tmp_path / 'x.jsonl'}"))
    assert _named(gone) == ["prompts.path"]
    shared = check(_settings(tiny_model_dir, "learner.gpus=[0]", "rollout.gpus=[0]"))
    assert "rollout.gpus" in _named(shared)  # the learner and the workers on one GPU


def test_the_paper_preset_lists_everything_it_lacks_here() -> None:
    found = _named(check(load_settings("paper")))
    assert found[:3] == ["model", "prompts.path", "rollout.engine.kind"]  # no model, data or vLLM here
    assert "sync.backend" in found  # nccl in a CPU torch


def test_up_stops_before_spawning_anything(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = clean_env()
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--preset", "demo", "--run-dir", str(run_dir)]
    done = subprocess.run(
        [*command, "--set", "model=/models/nope"], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 2
    assert "error: model: /models/nope does not exist" in done.stderr
    assert "Traceback" not in done.stderr and not run_dir.exists()  # nothing was started


def test_up_shortcuts_set_model_dataset_and_output_dir(tmp_path: Path) -> None:
    env = clean_env()
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--model", "/models/m", "--dataset", "d.jsonl"]
    done = subprocess.run(
        [*command, "--output-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2  # the preflight names what the shortcuts set:
    assert "error: model: /models/m does not exist" in done.stderr
    assert "error: prompts.path: d.jsonl" in done.stderr and not (tmp_path / "out").exists()


def test_the_gpu_sync_backends_name_what_they_lack(tiny_model_dir: Path) -> None:  # noqa: F811
    import importlib.util

    nccl4py = [p.message for p in check(_settings(tiny_model_dir, "sync.backend=nccl4py"))]
    if importlib.util.find_spec("nccl") is None:
        assert any("nccl4py is not installed" in m and "pip install 'nccl4py[cu12]'" in m for m in nccl4py)
    assert any("the learner is on the CPU: use gloo" in m for m in nccl4py)  # the demo learns on CPU
    native = check(_settings(tiny_model_dir, "sync.backend=vllm_nccl"))
    assert set(_named(native)) >= {"sync.backend"}
    assert any("set rollout.engine.kind=vllm" in p.message for p in native)  # the demo samples with torch
    if importlib.util.find_spec("vllm") is None:
        assert any("vLLM is not installed" in p.message for p in native)
    assert not any("LoRA" in p.message for p in native)
    lora = check(_settings(tiny_model_dir, "sync.backend=vllm_nccl", "learner.lora.r=8"))
    assert any("does not carry LoRA adapter versions" in p.message for p in lora)  # whole state dicts only


def test_up_on_ray_refuses_several_learner_ranks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--preset", "demo", "--ray"]
    command += ["--run-dir", str(run_dir)]
    done = subprocess.run(
        [*command, "--set", "learner.ranks=2"], capture_output=True, text=True, timeout=120, env=clean_env()
    )
    assert done.returncode == 2 and "learner.ranks > 1 runs the learner under torchrun" in done.stderr
    assert not run_dir.exists()
