"""vLLM's CPU build serving a LoRA run's versions as LoRA adapters (`rollout.engine.max_lora_rank`,
rollout/vllm_lora.py): each adapter version goes in under a new adapter id, no merge and no reload; vLLM's
log-probs of a fixed completion are Hugging Face's under the merged W0 + B A; a rank above the setting or
an adapter for another base is refused with the version held still serving, and so is a whole version
(vLLM's reload does not reach the layers its LoRA wraps)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _tiny import tiny_model_dir  # noqa: F401  (pytest fixture)
from test_engine_contract import require_vllm
from test_vllm_cpu import PROMPT, hf_logprobs

from sparkrl.services.common.modeling import load_model
from sparkrl.services.common.settings import SamplingSettings, VllmEngineSettings
from sparkrl.services.common.weight_sync import weights_checksum
from sparkrl.services.rollout.engine import WeightLoadFailed
from sparkrl.services.rollout.engines import make_engine
from sparkrl.services.rollout.install import VersionInstaller

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SETTINGS = VllmEngineSettings(device="cpu", dtype="float32", threads=1, kv_cache_gib=0.25, max_lora_rank=16)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Any]:  # noqa: F811
    require_vllm()
    engine = make_engine(tiny_model_dir, SETTINGS)
    yield engine
    engine.close()


def served_logprobs(engine: Any, prompt: list[int], completion: list[int]) -> np.ndarray:
    """vLLM's teacher-forced log-probs of `completion` under the adapter it serves now (if any)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    full = prompt + completion
    [out] = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=full)],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
        lora_request=engine._adapters.current,
    )
    return np.array([out.prompt_logprobs[i][full[i]].logprob for i in range(len(prompt), len(full))])


def random_adapter(base: torch.nn.Module, layers: list[str], rank: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    adapter = {}
    for layer in layers:
        out_features, in_features = base.get_submodule(layer).weight.shape
        adapter[f"{layer}.lora_A"] = 0.2 * torch.randn(rank, in_features, generator=generator)
        adapter[f"{layer}.lora_B"] = 0.2 * torch.randn(out_features, rank, generator=generator)
    return adapter


def test_adapter_versions_are_served_as_vllm_lora_adapters(engine: Any, tiny_model_dir: Path) -> None:  # noqa: F811
    assert engine.serves_adapters
    installer = VersionInstaller(engine, tiny_model_dir)
    prompt = engine.tokenizer(PROMPT)["input_ids"]
    completion = engine.tokenizer("3*7=21")["input_ids"]
    base = load_model(tiny_model_dir)
    layers = sorted(n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head")
    base_sum = weights_checksum((layer, base.get_submodule(layer).weight.float()) for layer in layers)
    before = engine.weights_checksum()
    for version in (1, 2, 3):
        adapter = random_adapter(base, layers, 8, version)
        installer.install(adapter, version, base_sum)
        assert engine.policy_version == version
        assert installer.checksum() == weights_checksum(sorted(adapter.items()))
        assert engine.weights_checksum() == before  # the base was never reloaded
        merged = load_model(tiny_model_dir)
        with torch.no_grad():
            for layer in layers:
                merged.get_submodule(layer).weight += adapter[f"{layer}.lora_B"] @ adapter[f"{layer}.lora_A"]
        expected = hf_logprobs(merged, prompt, completion)
        np.testing.assert_allclose(served_logprobs(engine, prompt, completion), expected, atol=1e-4)
    assert engine.llm.llm_engine.list_loras() == {engine._adapters.current.lora_int_id}  # the old ones gone
    sampled = engine.generate([prompt], SamplingSettings(n=2, max_new_tokens=6, topk_logprobs=4))
    assert all(set(c.policy_versions) == {3} for c in sampled[0])

    held = served_logprobs(engine, prompt, completion)
    with pytest.raises(WeightLoadFailed, match="max_lora_rank"):
        installer.install(random_adapter(base, layers, 32, 9), 4, base_sum)
    with pytest.raises(WeightLoadFailed, match="is not the learner's"):
        VersionInstaller(engine, tiny_model_dir).install(random_adapter(base, layers, 8, 9), 4, "0" * 64)
    assert engine.policy_version == 3
    np.testing.assert_allclose(served_logprobs(engine, prompt, completion), held, atol=0)

    # A whole version cannot be reloaded under vLLM's LoRA: refused before anything is touched.
    with pytest.raises(WeightLoadFailed, match="max_lora_rank is set"):
        installer.install(dict(base.state_dict()), 5, None)
    assert engine.policy_version == 3
    np.testing.assert_allclose(served_logprobs(engine, prompt, completion), held, atol=0)
