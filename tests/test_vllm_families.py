"""Gemma 2 in vLLM's CPU build, in process: the family whose vLLM model has no `lm_head` (its output layer
is the embedding), which the learner once sent its tied head to under that name.

- Every update the learner now publishes (the embedding once) loads, verified, and vLLM's log-probs are
  Hugging Face's under the new weights: the head follows its embedding.
- A tensor sent under a name vLLM's loader refuses is `WeightsDoNotFit` naming the tensor and vLLM's
  model class (the worker exits 78 on it and the run ends), not a failed update restored and retried.
"""

from __future__ import annotations

import copy as copy_module
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _families import build_family
from test_engine_contract import require_vllm
from test_vllm_cpu import SETTINGS, hf_logprobs
from transformers import PreTrainedModel

from sparkrl.services.common.modeling import load_model
from sparkrl.services.common.settings import SamplingSettings
from sparkrl.services.common.weight_sync import distinct_tensors, weights_checksum
from sparkrl.services.rollout.engine import EngineBroken, WeightsDoNotFit
from sparkrl.services.rollout.engines import make_engine

pytestmark = pytest.mark.vllm

STALE = 5


def stale_head(model: PreTrainedModel, head: torch.Tensor) -> PreTrainedModel:
    """`model` with its output layer untied and left at `head` (what a reload that missed it would hold)."""
    copy = copy_module.deepcopy(model)
    copy.lm_head.weight = torch.nn.Parameter(head.clone())
    return copy


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_family("gemma2", tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="module")
def engine(gemma2_dir: Path) -> Iterator[Any]:
    require_vllm()
    engine = make_engine(gemma2_dir, SETTINGS)
    yield engine
    engine.close()


def test_gemma2_takes_every_version_the_learner_publishes(engine: Any, gemma2_dir: Path) -> None:
    """After each update, what vLLM samples has Hugging Face's log-probs under the new weights (eager
    attention, as the learner's transformers runs Gemma 2: this venv's picks SDPA, which drops Gemma 2's
    attention soft-capping and differs by up to 1e-2). A head left on the old version would be off by
    far more: `STALE` times the mean difference, at least."""
    learner = load_model(gemma2_dir, attention="eager")
    assert learner.lm_head.weight is learner.get_input_embeddings().weight  # Gemma ties, always
    prompt = engine.tokenizer("Use 3 7 to make 21.")["input_ids"]
    generator = torch.Generator().manual_seed(0)
    previous = learner.get_input_embeddings().weight.detach().clone()
    for version in (1, 2):
        with torch.no_grad():
            for tensor in learner.parameters():
                tensor.add_(0.05 * torch.randn(tensor.shape, generator=generator))
        published = distinct_tensors(learner.state_dict())
        assert "lm_head.weight" not in published
        engine.load_weights(list(published.items()), version)
        assert engine.weights_checksum() == weights_checksum(published.items())
        [report] = engine.llm.collective_rpc("sparkrl_update_report")
        assert report["problems"] == []
        [group] = engine.generate(
            [prompt], SamplingSettings(n=4, max_new_tokens=8, topk_logprobs=4, seed=version)
        )
        for completion in group:
            expected = hf_logprobs(learner, prompt, completion.token_ids.tolist())
            np.testing.assert_allclose(completion.logprobs, expected, atol=1e-4)
            stale = hf_logprobs(stale_head(learner, previous), prompt, completion.token_ids.tolist())
            assert np.abs(stale - expected).mean() > STALE * np.abs(completion.logprobs - expected).mean()
        previous = published["model.embed_tokens.weight"].clone()


def test_a_name_vllms_loader_refuses_names_the_tensor_and_the_model(engine: Any, gemma2_dir: Path) -> None:
    """Sent under the head's own name (as before the fix), the tensor fails in vLLM's Gemma 2 loader."""
    state = dict(distinct_tensors(load_model(gemma2_dir).state_dict()))
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with pytest.raises(
        WeightsDoNotFit, match=r"Gemma2ForCausalLM has no parameter for tensor 'lm_head\.weight'"
    ):
        engine._try_install(list(state.items()), "0" * 64)  # below load_weights, which drops the alias
    with pytest.raises(EngineBroken):  # half-loaded: it refuses to generate; the worker exits instead
        engine.load_weights(list(distinct_tensors(load_model(gemma2_dir).state_dict()).items()), 9)


def test_a_mixture_of_experts_is_refused_before_vllm_starts(tmp_path: Path) -> None:
    """Qwen3-MoE on vLLM's CPU build: reloading the very same weights in place left the experts in the
    checkpoint's layout, not the kernel's (log-probs off by up to 4.2 nats, measured), so the engine refuses
    the model before it starts; the worker exits 78 on it and the run ends with the reason."""
    require_vllm()
    with pytest.raises(WeightsDoNotFit, match=r"a mixture of experts \(4 experts\): vLLM's CPU build"):
        make_engine(build_family("qwen3_moe", tmp_path), SETTINGS)
