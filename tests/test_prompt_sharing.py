"""Shared prompts (`learner.share_prompts`): a group's answers behind one copy of their prompt, a block
mask keeping each answer to its prompt and itself — each token's log-prob and entropy those of its own
padded row, and the gradient through the product's `run_updates` under real DeepSpeed the padded one's,
with fewer positions run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _learner import assert_same_gradient, gradient_and_stats, one_rank, settings
from _tiny import tiny_model_dir  # noqa: F401  (fixture)

from sparkrl.proto import TrajectoryGroup
from sparkrl.proto.testing import random_group
from sparkrl.services.common.settings import load_settings
from sparkrl.services.learner.batch import collate, padded_positions, samples_from_groups
from sparkrl.services.learner.logprobs import token_logp_and_entropy
from sparkrl.services.learner.prompt_sharing import share_prompts

VOCAB = 260  # the tiny model's byte-level vocabulary


def _groups(
    seed: int, count: int = 6, n: int = 6, temperatures: tuple[float, ...] = (1.0,)
) -> list[TrajectoryGroup]:
    """Groups of `n` answers of 1-10 tokens after prompts of 1-24 tokens (the first group's prompt is one
    token: no prefix), rewards mixed, temperatures in turn."""
    rng = np.random.default_rng(seed)
    groups = []
    for index in range(count):
        group = random_group(rng, n=n, k=8, vocab_size=VOCAB, max_new_tokens=10)
        length = 1 if index == 0 else int(rng.integers(12, 25))
        prompt = rng.integers(0, VOCAB, size=length).astype(np.int32)
        rewards = [0.0] * n if index % 4 == 1 else [float(r) for r in rng.integers(0, 2, size=n)]
        sampling = group.sampling.model_copy(update={"temperature": temperatures[index % len(temperatures)]})
        groups.append(
            group.model_copy(update={"prompt_token_ids": prompt, "rewards": rewards, "sampling": sampling})
        )
    return groups


def _by_target(mb: object, values: torch.Tensor) -> list[tuple[float, float]]:
    """(the rollout's log-prob, a value) of every target, sorted: the same targets in any layout."""
    mask = mb.mask  # type: ignore[attr-defined]
    return sorted(zip(mb.rollout_logp[mask].tolist(), values[mask].tolist(), strict=True))  # type: ignore[attr-defined]


def test_units_hold_every_target_once_and_run_fewer_positions() -> None:
    samples = samples_from_groups(_groups(0, temperatures=(1.0, 0.5)))
    padded, shared = collate(samples, pad_id=0), share_prompts(samples, pad_id=0, row_length=64)
    assert shared.num_tokens == padded.num_tokens
    for name in ("rollout_logp", "advantages"):
        values = getattr(shared, name)
        assert sorted(values[shared.mask].tolist()) == sorted(getattr(padded, name)[padded.mask].tolist())
    assert padded_positions(shared)[0] < padded_positions(padded)[0] / 2
    assert set(shared.temperature.flatten().tolist()) == {1.0, 0.5}
    # A group whose answers do not fit one row of 24 is cut into units, each with its prefix.
    small = share_prompts(samples, pad_id=0, row_length=24)
    assert small.num_tokens == padded.num_tokens and small.input_ids.shape[0] > shared.input_ids.shape[0]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("row_length", [None, 24, 96])
def test_each_token_gets_the_log_prob_and_entropy_of_its_own_row(
    attention: str,
    row_length: int | None,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    trainer = one_rank(settings(tiny_model_dir, tmp_path, f"learner.attention={attention}"))
    model = trainer.engine.module
    samples = samples_from_groups(_groups(1, temperatures=(1.0, 0.7)))
    padded, shared = collate(samples, pad_id=0), share_prompts(samples, pad_id=0, row_length=row_length)
    with torch.no_grad():
        logp_pad, entropy_pad = token_logp_and_entropy(model, padded)
        logp_shared, entropy_shared = token_logp_and_entropy(model, shared)
    want, got = torch.tensor(_by_target(padded, logp_pad)), torch.tensor(_by_target(shared, logp_shared))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    want, got = (
        torch.tensor(_by_target(padded, entropy_pad)),
        torch.tensor(_by_target(shared, entropy_shared)),
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


CASES = {
    "lp_reg, one micro-batch, skipped and packed": [
        "learner.loss.name=lp_reg", "learner.loss.rho=0.05", "learner.micro_batch_tokens=100000",
    ],
    "grpo, several micro-batches": ["learner.loss.name=grpo", "learner.micro_batch_tokens=300"],
    "kl_cov (runs every row)": ["learner.loss.name=kl_cov", "learner.micro_batch_tokens=100000"],
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_gradient_is_the_padded_ones(
    case: str,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    trainer = one_rank(settings(tiny_model_dir, tmp_path, "learner.lr=1e-3", *CASES[case]))
    groups = _groups(2, count=12, n=8)
    padded_grads, padded = gradient_and_stats(trainer, groups, skip_zero_advantage=False)
    shared_grads, shared = gradient_and_stats(
        trainer, groups, share_prompts=True, pack_length=96, skip_zero_advantage=True, entropy_of_skipped=True
    )
    assert_same_gradient(shared_grads, padded_grads)
    assert shared["loss"] == pytest.approx(padded["loss"], abs=1e-6)
    assert shared["entropy"] == pytest.approx(padded["entropy"], rel=1e-5)
    if trainer.cfg.loss.name == "lp_reg":
        assert shared["reg_tokens"] == padded["reg_tokens"] > 0 and shared["k_neg"] == padded["k_neg"]


def test_refused_where_a_row_must_be_one_sequence() -> None:
    with pytest.raises(ValueError, match="share_prompts"):
        load_settings("smoke", ["learner.share_prompts=true", "learner.loss.name=gspo"])
    with pytest.raises(ValueError, match="share_prompts"):
        load_settings("smoke", ["learner.share_prompts=true", "learner.loss_aggregation=seq_mean_token_mean"])
