"""How a vLLM worker is set up, from the main environment: the platform's defaults, the preflight of the
workers' vLLM (probed for real in .venv-vllm), the preset and the resolved interpreter path."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from _tiny import tiny_model_dir  # noqa: F401  (pytest fixture)
from pydantic import ValidationError
from test_engine_contract import NO_VLLM

from sparkrl import vllm_check
from sparkrl.plan import plan_stack
from sparkrl.preflight import check
from sparkrl.services.common.settings import VllmEngineSettings, load_settings
from sparkrl.services.rollout.vllm_launch import GIB, plan_launch

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        if os.environ.get("SPARKRL_REQUIRE_VLLM"):
            pytest.fail(NO_VLLM, pytrace=False)
        pytest.skip(NO_VLLM)
    return VLLM_PYTHON


def test_cpu_defaults_start_fast_and_share_prefixes() -> None:
    launch = plan_launch(VllmEngineSettings(), cpu=True, seed=7)
    assert (launch.in_process, launch.enforce_eager, launch.block_size) == (True, True, 32)
    assert launch.kv_cache_bytes == GIB and launch.env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    kwargs = launch.llm_kwargs("/m", VllmEngineSettings())
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["generation_config"] == "vllm"
    assert kwargs["kv_cache_memory_bytes"] == GIB and "gpu_memory_utilization" not in kwargs
    assert kwargs["seed"] == 7 and kwargs["max_logprobs"] == 1024 and kwargs["enable_prefix_caching"]
    assert "enable_lora" not in kwargs
    serving = VllmEngineSettings(max_lora_rank=16, max_loras=3)  # a LoRA run's adapters served as such
    lora = {k: launch.llm_kwargs("/m", serving)[k] for k in ("enable_lora", "max_lora_rank", "max_loras")}
    assert lora == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 3}


def test_gpu_defaults_are_vllms_own() -> None:
    launch = plan_launch(VllmEngineSettings(), cpu=False)
    assert (launch.in_process, launch.enforce_eager, launch.block_size, launch.kv_cache_bytes) == (
        False,
        False,
        None,
        None,
    )
    kwargs = launch.llm_kwargs("/m", VllmEngineSettings())
    assert kwargs["gpu_memory_utilization"] == 0.85 and "block_size" not in kwargs
    assert "async_scheduling" not in kwargs  # vLLM's own choice (on) for a spawned engine core
    in_process = VllmEngineSettings(in_process=True)  # in-flight updates: a step's tokens are its own pass's
    assert plan_launch(in_process, cpu=False).llm_kwargs("/m", in_process)["async_scheduling"] is False
    assert (
        plan_launch(VllmEngineSettings(), cpu=False).seed != plan_launch(VllmEngineSettings(), cpu=False).seed
    )


def test_threads_bind_nothing_in_an_engine_process() -> None:
    spawned = plan_launch(VllmEngineSettings(threads=3, in_process=False), cpu=True)
    assert spawned.env == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "3",
    }
    assert plan_launch(VllmEngineSettings(threads=3), cpu=True).threads == 3  # set in-process by the engine


def test_a_build_for_the_other_device_refuses_to_start() -> None:
    with pytest.raises(RuntimeError, match="installed vLLM is its CPU build"):
        plan_launch(VllmEngineSettings(device="cuda"), cpu=True)
    with pytest.raises(RuntimeError, match="GPU build: install vllm-cpu"):
        plan_launch(VllmEngineSettings(device="cpu"), cpu=False)
    with pytest.raises(ValidationError, match="multiple of 32"):
        VllmEngineSettings(device="cpu", block_size=48)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        plan_launch(VllmEngineSettings(block_size=48), cpu=True)


def test_the_preset_runs_vllm_in_its_environment_with_tis(tmp_path: Path) -> None:
    cfg = load_settings("vllm-cpu", [f"run_dir={tmp_path / 'run'}"])
    assert cfg.rollout.engine.kind == "vllm" and cfg.rollout.engine.device == "cpu"
    assert (cfg.learner.old_logp_source, cfg.learner.tis_cap) == ("recompute", 2.0)
    plan = plan_stack(cfg, workers=1, private_redis=True)
    worker = next(s for s in plan.services if s.name == "worker-0")
    # Absolute, yet still the venv's own interpreter (its symlink is not resolved to the base python).
    assert worker.command[0] == os.path.abspath(".venv-vllm/bin/python") == plan.settings.rollout.python


@pytest.mark.slow
def test_the_preflight_probes_the_workers_vllm(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    python = vllm_python()
    found = vllm_check.probe(str(python))
    assert found.error is None and found.dist == "vllm-cpu" and found.cpu is True
    assert vllm_check._version(found.version or "") >= vllm_check.MIN_VERSION and 32 in (
        found.head_sizes or []
    )
    base = [f"model={tiny_model_dir}", f"rollout.python={python}"]
    assert check(load_settings("vllm-cpu", base)) == []

    # A head size vLLM's CPU attention lacks (16), and sampling the engine refuses: each named.
    narrow = tmp_path / "narrow"
    shutil.copytree(tiny_model_dir, narrow)
    config = json.loads((narrow / "config.json").read_text())
    (narrow / "config.json").write_text(
        json.dumps(config | {"num_attention_heads": 8, "num_key_value_heads": 4})
    )
    overrides = [f"model={narrow}", f"rollout.python={python}", "rollout.sampling.top_p=0.9"]
    problems = {p.setting: p.message for p in check(load_settings("vllm-cpu", overrides))}
    assert set(problems) == {"model", "rollout.sampling.top_p"}
    assert problems["model"].startswith("head size 16 is not one vLLM's CPU attention runs")


def test_the_preflight_names_a_missing_environment(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    cfg = load_settings(
        "vllm-cpu", [f"model={tiny_model_dir}", f"rollout.python={tmp_path / 'none/bin/python'}"]
    )
    [problem] = check(cfg)
    assert problem.setting == "rollout.python" and "does not exist: `make vllm-env` builds" in problem.message
    # What a probe of an old GPU build reports, against the preset's `device: cpu`: both named.
    old = vllm_check.Found("py", dist="vllm", version="0.16.0", cpu=False, head_sizes=None)
    problems = dict(vllm_check.problems(cfg, old, None))
    assert "sparkrl needs vLLM ≥ 0.32" in problems["rollout.python"]
    assert "holds a GPU build of vLLM" in problems["rollout.engine.device"]


def test_the_preflight_refuses_vllm_lora_serving_where_versions_are_whole(tiny_model_dir: Path) -> None:  # noqa: F811
    """vLLM serving LoRA adapters (`max_lora_rank`) takes adapter versions only, of a rank it was started
    for: the preflight's engine check says which setting to change (its part that needs no vLLM probe)."""
    from sparkrl.preflight import _vllm_lora

    serving = [f"model={tiny_model_dir}", "rollout.engine.max_lora_rank=8"]
    for extra, said in [
        ([], "learner.lora.r is 0"),
        (["learner.lora.r=8", "learner.lora.sync=merged"], "learner.lora.sync is merged"),
        (["learner.lora.r=16"], "below learner.lora.r=16"),
    ]:
        [problem] = _vllm_lora(load_settings("vllm-cpu", serving + extra))
        assert problem.setting == "rollout.engine.max_lora_rank" and said in problem.message
    assert _vllm_lora(load_settings("vllm-cpu", [*serving, "learner.lora.r=8"])) == []
    assert _vllm_lora(load_settings("vllm-cpu", [f"model={tiny_model_dir}"])) == []
