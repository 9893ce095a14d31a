"""Exact work skipping (`learner.skip_zero_advantage`): a completion whose advantage is 0 is not run, and
the gradient is the one of the full pass — under real DeepSpeed, through the product's `run_updates`, for
every loss that allows it, at the micro-batch boundaries that decide Lp-Reg's k."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from _learner import assert_same_gradient, gradient_and_stats, one_rank, settings
from _tiny import tiny_model_dir  # noqa: F401  (fixture)

from sparkrl.proto import TrajectoryGroup
from sparkrl.proto.testing import random_group
from sparkrl.services.common.losses import loss_spec
from sparkrl.services.learner.batch import (
    collate,
    micro_batches,
    partition,
    samples_from_groups,
    update_micro_batches,
)
from sparkrl.services.learner.update import run_updates

VOCAB = 260  # the tiny model's byte-level vocabulary


def _groups(seed: int, count: int = 8) -> list[TrajectoryGroup]:
    """Half the groups all-equal (A = 0 on every answer), half with signal; answers of 3-12 tokens."""
    rng = np.random.default_rng(seed)
    groups = []
    for index in range(count):
        group = random_group(rng, n=4, k=8, vocab_size=VOCAB, max_new_tokens=12)
        prompt = group.prompt_token_ids[: int(rng.integers(6, 14))]
        rewards = (
            [1.0, 1.0, 1.0, 1.0] if index % 4 == 0 else [0.0] * 4 if index % 4 == 1 else [1.0, 0.0, 0.0, 1.0]
        )
        groups.append(group.model_copy(update={"prompt_token_ids": prompt, "rewards": rewards}))
    return groups


def test_skipping_keeps_the_micro_batches_and_drops_only_the_zero_advantage_samples() -> None:
    samples = samples_from_groups(_groups(0))
    parts = partition(samples, token_budget=160)
    assert len(parts) > 2
    skipped = update_micro_batches(parts, partial(collate, pad_id=0), skip_zero_advantage=True)
    kept_parts = [[s for s in part if s.advantage != 0 and s.num_tokens > 0] for part in parts]
    want = [collate(part, pad_id=0) for part in kept_parts if part]
    assert 0 < len(skipped) == len(want)
    for got, expected in zip(skipped, want, strict=True):
        for name in expected.__dataclass_fields__:
            a, b = getattr(got, name), getattr(expected, name)
            assert (a is None and b is None) or torch.equal(a, b), name
    nothing = [[s for s in part if s.advantage == 0] for part in parts]
    nothing = [part for part in nothing if part]
    (empty,) = update_micro_batches(nothing, partial(collate, pad_id=0), skip_zero_advantage=True)
    assert empty.num_tokens == 0  # one empty pass: the optimizer still steps


CASES = {
    "lp_reg": ["learner.loss.name=lp_reg", "learner.loss.rho=0.3", "learner.proxy_kappa=0.5"],
    "grpo": ["learner.loss.name=grpo"],
    "clip_higher": ["learner.loss.name=clip_higher"],
    "ppo_clip, sequence-mean aggregation, 2 updates": [
        "learner.loss.name=ppo_clip",
        "learner.loss_aggregation=seq_mean_token_mean",
        "learner.updates_per_rollout=2",
    ],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_skipping_zero_advantage_leaves_the_gradient_unchanged(
    case: str,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    # A small budget: several micro-batches, most mixing A = 0 rows with the others.
    overrides = ["learner.micro_batch_tokens=160", "learner.lr=1e-3", *CASES[case]]
    trainer = one_rank(settings(tiny_model_dir, tmp_path, *overrides))
    assert loss_spec(trainer.cfg.loss.name).zero_advantage_free
    groups = _groups(1)
    assert len(micro_batches(samples_from_groups(groups), 160, pad_id=0)) > 2
    full_grads, full = gradient_and_stats(trainer, groups, skip_zero_advantage=False)
    skip_grads, skipped = gradient_and_stats(trainer, groups, skip_zero_advantage=True)

    assert full["skipped_tokens"] == 0 and skipped["skipped_tokens"] > 0.3 * skipped["tokens"]
    assert skipped["tokens"] == full["tokens"]  # the divisor still counts them
    assert_same_gradient(skip_grads, full_grads)
    assert skipped["loss"] == pytest.approx(full["loss"], abs=1e-6)
    assert skipped["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-5)
    if trainer.cfg.loss.name == "lp_reg":  # the same tokens regularized, so the same k per micro-batch
        assert skipped["reg_tokens"] == full["reg_tokens"] > 0


def test_a_step_of_only_equal_groups_still_steps_the_optimizer(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Adam moves the weights on a zero gradient too (its momentum): skipping every row must not skip that."""
    trainer = one_rank(settings(tiny_model_dir, tmp_path, "learner.lr=1e-3"))
    groups = _groups(2)
    run_updates(trainer.engine, groups, trainer.cfg, trainer.pad_id, step=1)  # momentum from real signal
    equal = [g.model_copy(update={"rewards": [0.0] * 4}) for g in groups]
    grads, stats = gradient_and_stats(trainer, equal, skip_zero_advantage=True)
    assert stats["skipped_tokens"] == stats["tokens"] > 0 and stats["updates"] == 1
    assert grads and all(float(g.abs().max()) == 0.0 for g in grads)


@pytest.mark.parametrize("loss_name", ["kl_cov", "entropy_bonus"])
def test_losses_with_terms_on_zero_advantage_tokens_run_every_row(
    loss_name: str,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    trainer = one_rank(settings(tiny_model_dir, tmp_path, f"learner.loss.name={loss_name}"))
    assert trainer.cfg.skip_zero_advantage
    stats = run_updates(trainer.engine, _groups(3), trainer.cfg, trainer.pad_id, step=1).row()
    assert stats["skipped_tokens"] == 0


def _wide_groups(seed: int, count: int = 96) -> list[TrajectoryGroup]:
    """The wide preset's shape (configs/explore-wide.yaml): 16 answers a prompt, prompts of 21-23
    tokens, answers of 1-10 tokens, about a third of the groups all-equal (A = 0 on every answer)."""
    rng = np.random.default_rng(seed)
    groups = []
    for index in range(count):
        group = random_group(rng, n=16, k=20, vocab_size=VOCAB, max_new_tokens=10)
        prompt = group.prompt_token_ids[: int(rng.integers(21, 24))]
        if len(prompt) < 21:
            prompt = rng.integers(0, VOCAB, size=22).astype(np.int32)
        rewards = [1.0] * 16 if index % 3 == 0 else rng.integers(0, 2, size=16).astype(float).tolist()
        groups.append(group.model_copy(update={"prompt_token_ids": prompt, "rewards": rewards}))
    return groups


def test_the_wide_presets_step_packed_and_skipped_has_the_padded_full_gradient_and_entropy(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Lp-Reg at the paper's ρ = 1%, κ = 2%, the whole step in one micro-batch (the wide preset): packed
    into rows of 128 with A = 0 answers skipped and their entropy measured apart, the gradient, the loss, k
    and the entropy are the padded, unskipped pass's."""
    overrides = ["learner.loss.name=lp_reg", "learner.loss.rho=0.01", "learner.proxy_kappa=0.02",
                 "learner.micro_batch_tokens=196608", "learner.lr=1e-3"]  # fmt: skip
    trainer = one_rank(settings(tiny_model_dir, tmp_path, *overrides))
    groups = _wide_groups(4)
    full_grads, full = gradient_and_stats(trainer, groups, skip_zero_advantage=False)
    fast = {"skip_zero_advantage": True, "pack_length": 128, "entropy_of_skipped": True}
    fast_grads, packed = gradient_and_stats(trainer, groups, **fast)
    _, without = gradient_and_stats(trainer, groups, **(fast | {"entropy_of_skipped": False}))

    assert full["micro_batches"] == packed["micro_batches"] == 1  # one micro-batch: k is the step's
    assert full["k_neg"] >= 20 and packed["k_neg"] == full["k_neg"]
    assert (
        packed["skipped_tokens"] > 0.25 * packed["tokens"] and packed["padding_share"] < full["padding_share"]
    )
    assert_same_gradient(fast_grads, full_grads)
    assert packed["loss"] == pytest.approx(full["loss"], abs=1e-6)
    assert packed["reg_tokens"] == full["reg_tokens"]
    assert packed["entropy"] == pytest.approx(full["entropy"], rel=1e-5)  # over every token, as unskipped
    assert without["entropy"] != pytest.approx(full["entropy"], rel=1e-3)  # over the tokens run only
