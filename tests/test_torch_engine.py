"""The torch engine: log-probs equal a teacher-forced recomputation; stops, seeds, weight swaps."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from _tiny import tiny_model_dir  # noqa: F401  (pytest fixture)

from sparkrl.proto import Completion, Prompt
from sparkrl.services.common.settings import SamplingSettings, TorchEngineSettings
from sparkrl.services.common.weight_sync import weights_checksum
from sparkrl.services.rollout.batch import PromptBatch
from sparkrl.services.rollout.engine import WeightsDoNotFit
from sparkrl.services.rollout.torch_engine import TorchEngine

PROMPTS = ["Use 3 7 to make 21.\n", "Use 8 2 6 to make 40.\n", "Use 1 9 to make 10.\n"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[TorchEngine]:  # noqa: F811
    # max_batch_sequences below the row count: the chunked path runs too.
    engine = TorchEngine(tiny_model_dir, TorchEngineSettings(max_batch_sequences=4))
    yield engine
    engine.close()


def prompt_ids(engine: TorchEngine) -> list[list[int]]:
    ids = [engine.tokenizer(text)["input_ids"] for text in PROMPTS]
    assert len({len(p) for p in ids}) > 1  # unequal lengths: left padding is exercised
    return ids


@torch.no_grad()
def teacher_forced(engine: TorchEngine, prompt: list[int], completion: Completion, T: float) -> torch.Tensor:
    """log_softmax(logits / T) [n, V] at each completion position, from one unpadded forward pass."""
    ids = torch.tensor([prompt + completion.token_ids.tolist()])
    logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # row t predicts token t
    return torch.log_softmax(logits.float() / T, dim=-1)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (0.7, 0.8)])
def test_logprobs_match_teacher_forcing(engine: TorchEngine, temperature: float, top_p: float) -> None:
    prompts = prompt_ids(engine)
    sampling = SamplingSettings(
        n=2, temperature=temperature, top_p=top_p, max_new_tokens=12, topk_logprobs=5, seed=3
    )
    groups = engine.generate(prompts, sampling)
    assert [len(g) for g in groups] == [2, 2, 2]
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            expected = teacher_forced(engine, prompt, c, temperature)  # [n, V]
            token_ids = torch.from_numpy(c.token_ids).long()
            sampled = expected.gather(1, token_ids[:, None]).squeeze(1)
            # Top-p only restricts sampling: log-probs are those of the untruncated T distribution.
            np.testing.assert_allclose(c.logprobs, sampled.numpy(), atol=1e-4)
            np.testing.assert_allclose(c.topk_logprobs, expected.topk(5).values.numpy(), atol=1e-4)
            at_ids = expected.gather(1, torch.from_numpy(c.topk_ids).long())
            np.testing.assert_allclose(c.topk_logprobs, at_ids.numpy(), atol=1e-4)


def test_top_p_samples_inside_the_nucleus(engine: TorchEngine) -> None:
    sampling = SamplingSettings(n=8, temperature=1.0, top_p=0.3, max_new_tokens=6, topk_logprobs=20, seed=5)
    for group in engine.generate(prompt_ids(engine), sampling):
        for c in group:
            probs = np.exp(c.topk_logprobs)  # [n, K], sorted descending
            rank = (c.topk_ids == c.token_ids[:, None]).argmax(axis=1)
            assert (c.topk_ids == c.token_ids[:, None]).any(axis=1).all()
            mass_before = (
                np.cumsum(probs, axis=1)[np.arange(len(rank)), rank] - probs[np.arange(len(rank)), rank]
            )
            assert (mass_before < 0.3 + 1e-5).all()


def test_shapes_versions_and_sorting(engine: TorchEngine) -> None:
    groups = engine.generate(prompt_ids(engine), SamplingSettings(n=3, max_new_tokens=10, topk_logprobs=7))
    for group in groups:
        for c in group:
            T = c.num_tokens
            assert 1 <= T <= 10
            assert c.topk_ids.shape == c.topk_logprobs.shape == (T, 7)
            assert c.token_ids.dtype == c.topk_ids.dtype == c.policy_versions.dtype == np.int32
            assert c.logprobs.dtype == c.topk_logprobs.dtype == np.float32
            assert (np.diff(c.topk_logprobs, axis=1) <= 0).all()
            assert (c.topk_logprobs[:, 0] >= c.logprobs - 1e-6).all()
            assert (c.policy_versions == engine.policy_version).all()
            assert (c.token_ids < engine.vocab_size).all() and (c.topk_ids < engine.vocab_size).all()
            if c.finish_reason == "stop":  # EOS: kept as the last token, left out of the text
                assert c.token_ids[-1] == engine.tokenizer.eos_token_id
            assert c.text == engine.tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True)


def test_stop_strings_end_and_are_trimmed(engine: TorchEngine) -> None:
    stops = ["+", "-", "*", "/"]
    sampling = SamplingSettings(n=8, max_new_tokens=12, stop=stops, seed=11)
    completions = [c for group in engine.generate(prompt_ids(engine), sampling) for c in group]
    by_stop = 0
    for c in completions:
        full = engine.tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True)
        assert not any(stop in c.text for stop in stops) and full.startswith(c.text)
        if any(stop in full for stop in stops):  # ended by the stop string: nothing sampled after it
            by_stop += 1
            assert c.finish_reason == "stop" and full[len(c.text)] in stops and full[-1] in stops
    assert by_stop > 0


def test_max_new_tokens_gives_length(engine: TorchEngine) -> None:
    groups = engine.generate(prompt_ids(engine), SamplingSettings(n=4, max_new_tokens=2, seed=1))
    completions = [c for group in groups for c in group]
    assert all(c.num_tokens <= 2 for c in completions)
    assert any(c.finish_reason == "length" for c in completions)
    for c in completions:
        ended_by_eos = c.token_ids[-1] == engine.tokenizer.eos_token_id
        assert c.finish_reason == ("stop" if ended_by_eos else "length")


def test_min_new_tokens_holds_eos_back_but_not_the_log_probs(engine: TorchEngine) -> None:
    eos = engine.tokenizer.eos_token_id
    free = SamplingSettings(n=8, max_new_tokens=40, seed=3)
    assert any(c.finish_reason == "stop" for g in engine.generate(prompt_ids(engine), free) for c in g)
    fixed = SamplingSettings(n=8, max_new_tokens=40, min_new_tokens=40, seed=3)
    completions = [c for group in engine.generate(prompt_ids(engine), fixed) for c in group]
    assert all(c.num_tokens == 40 and c.finish_reason == "length" for c in completions)
    assert all(eos not in c.token_ids.tolist() for c in completions)
    # EOS is masked out of the sampling only: the recorded log-probs are the model's, EOS among them.
    prompt = prompt_ids(engine)[0]
    expected = teacher_forced(engine, prompt, completions[0], T=1.0)  # [40, V]
    np.testing.assert_allclose(completions[0].topk_logprobs, expected.topk(20).values.numpy(), atol=1e-4)
    sampled = expected.gather(1, torch.from_numpy(completions[0].token_ids).long()[:, None]).squeeze(1)
    np.testing.assert_allclose(completions[0].logprobs, sampled.numpy(), atol=1e-4)
    with pytest.raises(ValueError, match="exceeds max_new_tokens"):
        SamplingSettings(max_new_tokens=8, min_new_tokens=9)
    with pytest.raises(ValueError, match="stop strings"):
        SamplingSettings(max_new_tokens=8, min_new_tokens=8, stop=["+"])


def test_seed_reproduces_and_varies(engine: TorchEngine) -> None:
    def run(seed: int | None) -> list[list[int]]:
        sampling = SamplingSettings(n=4, max_new_tokens=8, seed=seed)
        return [c.token_ids.tolist() for g in engine.generate(prompt_ids(engine), sampling) for c in g]

    assert run(42) == run(42)
    assert run(42) != run(43)
    assert run(None) != run(None)


def test_a_runs_seed_gives_each_batch_its_own_draws(engine: TorchEngine) -> None:
    """`rollout.sampling.seed` reaches the engine through the batch (`PromptBatch.sampling`): the same
    prompts fed again as other prompts (other ids) draw anew, the same batch draws the same. (The seed
    as such for every call made every batch draw the same numbers: a rare token taken by the same
    samples step after step.)"""
    run_seed = SamplingSettings(n=4, max_new_tokens=8, seed=42)

    def batch(first_id: int) -> PromptBatch:
        prompts = [
            Prompt(prompt_id=f"train-{first_id + i:06d}", task="countdown", text=t)
            for i, t in enumerate(PROMPTS)
        ]
        return PromptBatch([], prompts, prompt_ids(engine))

    def draws(b: PromptBatch) -> list[list[int]]:
        return tokens_of(engine.generate(b.token_ids, b.sampling(run_seed)))

    first, second = batch(0), batch(3)
    assert first.sampling(run_seed).seed == batch(0).sampling(run_seed).seed != second.sampling(run_seed).seed
    assert draws(first) == draws(batch(0)) != draws(second)
    assert first.sampling(SamplingSettings(n=4)) == SamplingSettings(n=4)  # unseeded: as given


def tokens_of(groups: list[list[Completion]]) -> list[list[int]]:
    return [c.token_ids.tolist() for group in groups for c in group]


def logprobs_of(groups: list[list[Completion]]) -> list[list[float]]:
    return [c.logprobs.tolist() for group in groups for c in group]


def test_load_weights_swaps_in_place(engine: TorchEngine) -> None:
    sampling = SamplingSettings(n=2, max_new_tokens=8, seed=9)
    prompts = prompt_ids(engine)
    original = {name: t.detach().clone() for name, t in engine.model.state_dict().items()}
    version, checksum = engine.policy_version, engine.weights_checksum()
    before = engine.generate(prompts, sampling)
    assert checksum == weights_checksum(original.items())  # what the learner computes for these weights
    generator = torch.Generator().manual_seed(0)
    noisy = {name: t + 0.5 * torch.randn(t.shape, generator=generator) for name, t in original.items()}
    try:
        engine.load_weights(noisy.items(), version=version + 3)
        assert engine.policy_version == version + 3
        assert engine.weights_checksum() == weights_checksum(noisy.items()) != checksum
        after = engine.generate(prompts, sampling)
        assert all((c.policy_versions == version + 3).all() for g in after for c in g)
        assert logprobs_of(after) != logprobs_of(before)
    finally:
        engine.load_weights(original.items(), version=version + 4)
    assert engine.weights_checksum() == checksum
    restored = engine.generate(prompts, sampling)
    assert tokens_of(restored) == tokens_of(before)


def test_load_weights_rejects_unknown_names_and_shapes(engine: TorchEngine) -> None:
    version = engine.policy_version
    with pytest.raises(WeightsDoNotFit, match=r"'model\.not_a_layer\.weight', which Qwen2ForCausalLM"):
        engine.load_weights([("model.not_a_layer.weight", torch.zeros(1))], version=version + 1)
    name, tensor = next(iter(engine.model.state_dict().items()))
    with pytest.raises(WeightsDoNotFit, match="shape"):
        engine.load_weights([(name, torch.zeros(tensor.shape[0] + 1))], version=version + 1)
    assert engine.policy_version == version
