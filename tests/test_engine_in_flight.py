"""In-flight weight updates and continued samples, on every engine (torch here; vLLM's CPU build in
.venv-vllm, `-m vllm`): a version installed between two decoding steps tags every later token, and those
tokens are what the new weights sample — exactly, when the cache is recomputed at the swap; with the cache
kept, what the new weights sample on the old weights' keys and values (PipelineRL's mixture, computed here
by hand). A stopped batch hands back its rows cut short, and a continued row keeps its prefix.

Reference numbers come from the Hugging Face model on CPU, teacher-forced, never from the engine under
test.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from _tiny import tiny_model_dir  # noqa: F401  (pytest fixture)
from test_engine_contract import ENGINES, TOLERANCE, kind, prompt_ids, require_vllm
from transformers import PreTrainedModel

from sparkrl.proto import Completion
from sparkrl.services.common.modeling import load_model
from sparkrl.services.common.settings import SamplingSettings, TorchEngineSettings, VllmEngineSettings
from sparkrl.services.common.settings.rollout import RolloutSettings
from sparkrl.services.rollout.engine import Engine, Interrupts
from sparkrl.services.rollout.engines import make_engine

SWAP_AT = 5  # the poll that installs the new version (after that many decoding steps)
# Noised weights sample near-uniformly: completions run to max_new_tokens but for a rare early EOS (the
# vLLM engine refuses min_new_tokens), so most rows hold tokens of both versions.
SAMPLING = SamplingSettings(n=4, max_new_tokens=16, topk_logprobs=4, seed=5)


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Engine]:  # noqa: F811
    if request.param == "torch":
        settings: TorchEngineSettings | VllmEngineSettings = TorchEngineSettings()
    else:
        require_vllm()
        settings = VllmEngineSettings(dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3)
    engine = make_engine(tiny_model_dir, settings)
    yield engine
    engine.close()


def noised(model_dir: Path, seed: int) -> PreTrainedModel:
    model = load_model(model_dir, "float32", "cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path) -> tuple[PreTrainedModel, PreTrainedModel]:  # noqa: F811
    """Two versions that sample differently: (the one held first, the one swapped in)."""
    return noised(tiny_model_dir, 0), noised(tiny_model_dir, 1)


def weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def swapping(engine: Engine, new: dict[str, torch.Tensor], version: int, at: int) -> Callable[[], bool]:
    """A poll that installs `new` as `version` on its `at`-th call, and never stops the batch."""
    calls = [0]

    def poll() -> bool:
        calls[0] += 1
        if calls[0] == at:
            engine.load_weights(new.items(), version)
        return False

    return poll


@torch.no_grad()
def forced(model: PreTrainedModel, prompt: list[int], c: Completion) -> torch.Tensor:
    """log_softmax(logits) [T, V] at each completion position (T = 1), one unpadded pass."""
    ids = torch.tensor([prompt + c.token_ids.tolist()])
    return torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)


@torch.no_grad()
def kept_cache(
    old: PreTrainedModel, new: PreTrainedModel, prompt: list[int], c: Completion, first_new: int
) -> torch.Tensor:
    """What a worker that keeps its cache samples after a swap before token `first_new`: the new weights
    run token first_new - 1 onwards on keys and values the old ones computed for the prompt and the tokens
    before it. log_softmax [T - first_new, V] at positions first_new ... T - 1."""
    tokens = c.token_ids.tolist()
    # transformers 5 renamed `past_key_values` to `cache`; vLLM's environment has an older one.
    name = "cache" if "cache" in inspect.signature(new.forward).parameters else "past_key_values"
    before = old(input_ids=torch.tensor([prompt + tokens[: first_new - 1]]), use_cache=True)
    after = new(input_ids=torch.tensor([tokens[first_new - 1 : -1]]), **{name: getattr(before, name)})
    return torch.log_softmax(after.logits[0].float(), dim=-1)


def assert_sampled_from(c: Completion, logp: torch.Tensor, at: slice, atol: float) -> None:
    """The completion's log-probs and top-k at positions `at` are those of `logp` (its rows for `at`)."""
    ids = torch.from_numpy(c.token_ids[at].astype(np.int64))
    np.testing.assert_allclose(c.logprobs[at], logp.gather(1, ids[:, None]).squeeze(1).numpy(), atol=atol)
    K = c.topk_ids.shape[1]
    np.testing.assert_allclose(c.topk_logprobs[at], logp.topk(K).values.numpy(), atol=atol)


def generate_with_swap(
    engine: Engine, old: PreTrainedModel, new: PreTrainedModel, kv_cache: str
) -> tuple[list[list[int]], list[Completion], int]:
    """(prompts, every row as (prompt index, completion), the first version): sampled by `old`'s weights
    with a swap to `new`'s at poll SWAP_AT."""
    version = engine.policy_version + 1
    engine.load_weights(weights(old).items(), version)
    prompts = prompt_ids(engine)
    poll = swapping(engine, weights(new), version + 1, SWAP_AT)
    groups = engine.generate(prompts, SAMPLING, interrupts=Interrupts(poll, kv_cache))  # type: ignore[arg-type]
    return prompts, [(i, c) for i, group in enumerate(groups) for c in group], version


def mixed(rows: list[tuple[int, Completion]], version: int) -> list[tuple[int, Completion, int]]:
    """The rows holding tokens of both versions, with the first token of the newer."""
    found = []
    for i, c in rows:
        assert set(c.policy_versions.tolist()) <= {version, version + 1}
        assert (np.diff(c.policy_versions) >= 0).all()  # versions only move forward along a sample
        if version + 1 in c.policy_versions:
            found.append((i, c, int(np.argmax(c.policy_versions == version + 1))))
    assert len(found) >= len(rows) // 2, "most rows should outlive the swap"
    return found


def test_a_version_taken_mid_generation_tags_later_tokens_and_recomputed_they_are_the_new_weights(
    engine: Engine, models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    old, new = models
    prompts, rows, version = generate_with_swap(engine, old, new, "recompute")
    atol = TOLERANCE[kind(engine)]
    for i, c, swap in mixed(rows, version):
        assert 0 < swap < c.num_tokens
        assert_sampled_from(c, forced(old, prompts[i], c)[:swap], slice(0, swap), atol)
        assert_sampled_from(c, forced(new, prompts[i], c)[swap:], slice(swap, None), atol)


def test_with_the_cache_kept_later_tokens_are_the_new_weights_on_the_old_keys_and_values(
    engine: Engine, models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    old, new = models
    prompts, rows, version = generate_with_swap(engine, old, new, "keep")
    atol = TOLERANCE[kind(engine)]
    off = []
    for i, c, swap in mixed(rows, version):
        assert_sampled_from(c, forced(old, prompts[i], c)[:swap], slice(0, swap), atol)
        assert_sampled_from(c, kept_cache(old, new, prompts[i], c, swap), slice(swap, None), atol)
        own = forced(new, prompts[i], c)[swap:].gather(
            1, torch.from_numpy(c.token_ids[swap:].astype(np.int64))[:, None]
        )
        off.append(float((own.squeeze(1) - torch.from_numpy(c.logprobs[swap:])).abs().max()))
    # Not the new version's own distribution: the difference is what the learner's ratios account for.
    assert max(off) > 10 * atol


def test_a_stopped_batch_hands_back_rows_cut_short_and_continued_rows_keep_their_prefix(
    engine: Engine, models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    old, _ = models
    engine.load_weights(weights(old).items(), engine.policy_version + 1)
    prompts = prompt_ids(engine)
    calls = [0]

    def stop_at_the_fourth_poll() -> bool:
        calls[0] += 1
        return calls[0] >= 4

    cut = engine.generate(prompts, SAMPLING, interrupts=Interrupts(stop_at_the_fourth_poll))
    rows = [c for group in cut for c in group]
    assert all(c.finish_reason in ("abort", "stop") for c in rows)
    assert all(1 <= c.num_tokens < SAMPLING.max_new_tokens for c in rows if c.finish_reason == "abort")
    assert sum(c.finish_reason == "abort" for c in rows) >= len(rows) // 2
    # Continued: the rows cut short from their prefix; finished ones pass through; None: from the prompt.
    prefixes: list[list[Completion | None]] = [list(group) for group in cut]
    prefixes[1][1] = None
    engine.load_weights(weights(old).items(), engine.policy_version + 1)  # a newer version continues them
    groups = engine.generate(prompts, SAMPLING, prefixes=prefixes)
    atol = TOLERANCE[kind(engine)]
    for prompt, group, given in zip(prompts, groups, prefixes, strict=True):
        for c, prefix in zip(group, given, strict=True):
            assert c.finish_reason in ("stop", "length")
            if prefix is not None and prefix.finish_reason != "abort":
                assert c == prefix  # finished already: passed through
                continue
            if prefix is not None:
                T = prefix.num_tokens
                assert c.num_tokens > T and c.token_ids[:T].tolist() == prefix.token_ids.tolist()
                np.testing.assert_array_equal(c.logprobs[:T], prefix.logprobs)
                assert c.policy_versions[:T].tolist() == prefix.policy_versions.tolist()
                assert (c.policy_versions[T:] == engine.policy_version).all()
            assert_sampled_from(c, forced(old, prompt, c), slice(0, None), atol)
            assert c.text == engine.tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True)


def test_prefixes_that_do_not_fit_are_refused(engine: Engine) -> None:
    prompts = prompt_ids(engine)[:1]
    [[c]] = engine.generate(prompts, SamplingSettings(n=1, max_new_tokens=4, topk_logprobs=4, seed=1))
    aborted = c.model_copy(update={"finish_reason": "abort"})
    with pytest.raises(ValueError, match=r"prefixes, sampling\.n is 2"):
        engine.generate(prompts, SamplingSettings(n=2, topk_logprobs=4), prefixes=[[aborted]])
    with pytest.raises(ValueError, match="top-4, the request asks for top-3"):
        engine.generate(prompts, SamplingSettings(n=1, topk_logprobs=3), prefixes=[[aborted]])
    with pytest.raises(ValueError, match="nothing left to sample"):
        budget = SamplingSettings(n=1, max_new_tokens=c.num_tokens, topk_logprobs=4)
        engine.generate(prompts, budget, prefixes=[[aborted]])


def test_in_flight_updates_on_vllm_need_the_engine_core_in_process_and_no_served_adapters() -> None:
    """Refused at settings time, naming the fix: a spawned engine core decodes on its own (no token
    boundary for the new version), and a served LoRA adapter is named by each request when it begins."""
    in_flight = {"weight_updates": "in_flight"}
    for engine in ({"kind": "vllm", "in_process": False}, {"kind": "vllm", "device": "cuda"}):
        with pytest.raises(ValueError, match=r"rollout\.engine\.in_process true"):
            RolloutSettings.model_validate(in_flight | {"engine": engine})
    with pytest.raises(ValueError, match="unset max_lora_rank"):
        RolloutSettings.model_validate(in_flight | {"engine": {"kind": "vllm", "max_lora_rank": 16}})
    fine = ({"kind": "vllm"}, {"kind": "vllm", "device": "cuda", "in_process": True}, {"kind": "torch"})
    for engine in fine:
        RolloutSettings.model_validate(in_flight | {"engine": engine})
