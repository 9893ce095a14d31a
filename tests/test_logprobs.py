"""The chunked log-prob / entropy / Lp-Reg proxy pass (logprobs.py) against the full-logits reference, on
the tiny model: forward values and parameter gradients, uneven chunks, the fallback, and the pass through
a DeepSpeed engine."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from deepspeed.utils import safe_get_full_grad
from torch.testing import assert_close

from sparkrl.proto.testing import random_group
from sparkrl.services.common.modeling import load_model
from sparkrl.services.common.settings import load_settings
from sparkrl.services.learner.batch import MicroBatch, micro_batches, samples_from_groups
from sparkrl.services.learner.logprobs import (
    chunk_tokens,
    final_hidden,
    full_logits_reference,
    old_logp_and_proxy,
    supports_chunking,
    token_logp_and_entropy,
)
from sparkrl.services.learner.proxy import proxy_logp_from_logits
from sparkrl.services.learner.trainer import build_engine, init_distributed
from sparkrl.services.learner.update import old_policy

VOCAB = 260  # the tiny model's byte-level vocabulary
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _micro_batch(seed: int = 0, token_budget: int = 10_000) -> list[MicroBatch]:
    """Ragged rows: prompts of 4-12 tokens, completions of 1-10, two sampling temperatures."""
    rng = np.random.default_rng(seed)
    groups = []
    for index in range(3):
        group = random_group(rng, n=4, k=8, vocab_size=VOCAB, max_new_tokens=10)
        sampling = group.sampling.model_copy(update={"temperature": (1.0, 0.7)[index % 2]})
        prompt = group.prompt_token_ids[: 4 + 4 * index]
        groups.append(group.model_copy(update={"prompt_token_ids": prompt, "sampling": sampling}))
    return micro_batches(samples_from_groups(groups), token_budget=token_budget, pad_id=0)


def _loss(logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((logp + 0.1 * entropy) * mask).sum() / mask.sum()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("chunk", [1, 7, None])
def test_chunked_logp_and_entropy_and_their_gradients_match_the_full_logits_pass(
    chunk: int | None,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    model = load_model(tiny_model_dir)
    (mb,) = _micro_batch()
    rows = mb.num_tokens  # only the positions that predict a generated token go through the head
    assert final_hidden(model, mb).states.shape[0] == rows < mb.mask.numel() // 2
    assert rows % 7, "7 should split the rows unevenly"
    want_logp, want_entropy, _ = full_logits_reference(model, mb, entropy_grad=True)
    _loss(want_logp, want_entropy, mb.mask).backward()
    want_grads = _grads(model)

    logp, entropy = token_logp_and_entropy(model, mb, entropy_grad=True, chunk=chunk)
    assert logp.shape == entropy.shape == mb.mask.shape
    assert_close(logp[mb.mask], want_logp[mb.mask], **TOL)
    assert_close(entropy[mb.mask], want_entropy[mb.mask], **TOL)
    assert not logp[~mb.mask].any() and not entropy[~mb.mask].any()  # zeros elsewhere
    _loss(logp, entropy, mb.mask).backward()
    assert_close(_grads(model), want_grads, **TOL)


def test_the_entropy_is_a_measurement_unless_asked_and_nothing_is_kept_without_grad(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    model = load_model(tiny_model_dir)
    (mb,) = _micro_batch(1)
    logp, entropy = token_logp_and_entropy(model, mb, entropy_grad=False, chunk=5)
    assert logp.requires_grad and not entropy.requires_grad
    want_logp, want_entropy, _ = full_logits_reference(model, mb, entropy_grad=False)
    _loss(want_logp, want_entropy, mb.mask).backward()  # no gradient through the entropy
    want_grads = _grads(model)
    _loss(logp, entropy, mb.mask).backward()
    assert_close(_grads(model), want_grads, **TOL)
    with torch.no_grad():
        logp, entropy = token_logp_and_entropy(model, mb, chunk=5)
    assert not logp.requires_grad and not entropy.requires_grad
    assert_close(entropy[mb.mask], want_entropy[mb.mask], **TOL)


@pytest.mark.parametrize("chunk", [1, 7, None])
def test_old_logp_and_the_logits_proxy_match_the_full_logits_pass(
    chunk: int | None,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    model = load_model(tiny_model_dir)
    (mb,) = _micro_batch(2)
    with torch.no_grad():
        want_logp, _, logits = full_logits_reference(model, mb, entropy_grad=False)
    # κ = 1e-4: about half of these random tokens are filtered out (−inf) by the tiny model's π_old.
    want_proxy = proxy_logp_from_logits(logits, mb.input_ids[:, 1:], kappa=1e-4)  # logits already / T
    logp, proxy = old_logp_and_proxy(model, mb, kappa=1e-4, chunk=chunk)
    assert proxy is not None and proxy.shape == mb.mask.shape
    assert_close(logp[mb.mask], want_logp[mb.mask], **TOL)
    assert_close(proxy[mb.mask], want_proxy[mb.mask], **TOL)  # −inf where filtered, on both sides
    assert proxy[mb.mask].isneginf().any() and proxy[mb.mask].isfinite().any()
    assert old_logp_and_proxy(model, mb, kappa=None, chunk=chunk)[1] is None


def test_old_policy_takes_the_proxy_from_logits_and_an_on_policy_ratio_of_exactly_one(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    model = load_model(tiny_model_dir)
    overrides = ["learner.proxy_source=logits", "learner.old_logp_source=recompute", "learner.tis_cap=null"]
    cfg = load_settings("smoke", overrides).learner
    (mb,) = _micro_batch(3)
    old = old_policy(model, mb, cfg, reference=copy.deepcopy(model))
    with torch.no_grad():
        want_logp, _, logits = full_logits_reference(model, mb, entropy_grad=False)
    want_proxy = proxy_logp_from_logits(logits, mb.input_ids[:, 1:], kappa=cfg.proxy_kappa)
    assert old.proxy_inexact == 0
    assert_close(old.proxy_logp[mb.mask], want_proxy[mb.mask], **TOL)
    assert_close(old.old_logp[mb.mask], want_logp[mb.mask], **TOL)
    assert old.ref_logp is not None and torch.equal(old.ref_logp, old.old_logp)
    logp, _ = token_logp_and_entropy(model, mb, entropy_grad=False)
    assert torch.equal(logp.detach()[mb.mask], old.old_logp[mb.mask])  # the same chunks, bit for bit


class _NoAccessors(torch.nn.Module):
    """A causal LM as far as the learner can tell (input ids → `.logits`), without HF's accessors."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> object:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


def test_models_the_chunks_cannot_reproduce_take_the_full_logits_path(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    model = load_model(tiny_model_dir)
    (mb,) = _micro_batch(4)
    assert supports_chunking(model)
    softcapped = copy.deepcopy(model)
    softcapped.config.final_logit_softcapping = 30.0  # Qwen2 ignores it; a Gemma would not
    wrapped = _NoAccessors(model)
    assert not supports_chunking(softcapped) and not supports_chunking(wrapped)
    for fallback in (softcapped, wrapped):
        want_logp, want_entropy, logits = full_logits_reference(fallback, mb, entropy_grad=True)
        logp, entropy = token_logp_and_entropy(fallback, mb, entropy_grad=True, chunk=3)
        assert torch.equal(logp, want_logp) and torch.equal(entropy, want_entropy)
        assert logp.requires_grad and entropy.requires_grad
        old_logp, proxy = old_logp_and_proxy(fallback, mb, kappa=0.02, chunk=3)
        assert torch.equal(old_logp, want_logp.detach())
        want_proxy = proxy_logp_from_logits(logits, mb.input_ids[:, 1:], kappa=0.02)
        assert proxy is not None and torch.equal(proxy, want_proxy)
    chunked_logp, _ = token_logp_and_entropy(model, mb)
    assert_close(chunked_logp[mb.mask], want_logp[mb.mask], **TOL)


def test_chunks_hold_about_256_mib_of_float32_logits() -> None:
    assert chunk_tokens(151_936) == 441  # 441 × 151,936 × 4 B ≈ 256 MiB
    assert chunk_tokens(260) == 258_111 and chunk_tokens(10**12) == 1


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_through_a_deepspeed_engine_the_gradients_are_the_references_and_its_outputs_take_theirs_first(
    zero_stage: int,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    model = load_model(tiny_model_dir)
    reference = copy.deepcopy(model)
    batches = _micro_batch(5, token_budget=100)
    assert len(batches) > 1, "the test should accumulate over micro-batches"
    for mb in batches:
        _loss(*full_logits_reference(reference, mb, entropy_grad=True)[:2], mb.mask).backward()
    cfg = load_settings("smoke", [f"learner.zero_stage={zero_stage}"]).learner
    init_distributed(cfg)
    engine = build_engine(model, cfg)
    # ZeRO's bookkeeping (the backward prologue) runs from hooks on the engine's forward outputs; the
    # chunked logits are computed outside that forward, and must not reach a parameter before they do.
    events: list[str] = []

    def on_outputs(module: torch.nn.Module, args: object, out: Any) -> None:
        out.logits.register_hook(lambda grad: events.append("outputs"))

    engine.module.register_forward_hook(on_outputs)
    engine.module.lm_head.weight.register_post_accumulate_grad_hook(lambda _: events.append("lm_head"))
    for index, mb in enumerate(batches):
        engine.set_gradient_accumulation_boundary(index == len(batches) - 1)
        logp, entropy = token_logp_and_entropy(engine, mb, entropy_grad=True, chunk=7)
        engine.backward(_loss(logp, entropy, mb.mask), scale_wrt_gas=False)
    grads = {name: safe_get_full_grad(p) for name, p in engine.module.named_parameters()}
    # ZeRO-3 partitions and reduces in its own order: float32 sums a few ulps apart, hence 1e-4.
    assert_close(grads, {name: p.grad for name, p in reference.named_parameters()}, atol=1e-4, rtol=1e-4)
    assert events == ["outputs", "lm_head"] * len(batches)
