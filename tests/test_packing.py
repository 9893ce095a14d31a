"""Sequence packing (`learner.pack_length`): a micro-batch's completions share rows, each with position ids
from 0 so that attention does not cross them — and the gradient is the one of the padded rows, under real
DeepSpeed, through the product's `run_updates`, at the micro-batch boundaries that decide Lp-Reg's k."""

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
from sparkrl.services.learner.batch import collate, pack, partition, samples_from_groups
from sparkrl.services.learner.logprobs import token_logp_and_entropy

VOCAB = 260  # the tiny model's byte-level vocabulary


def _groups(seed: int, count: int = 8, temperatures: tuple[float, ...] = (1.0,)) -> list[TrajectoryGroup]:
    """Groups of 4 answers of 1-12 tokens after prompts of 3-13, rewards mixed (some groups all equal)."""
    rng = np.random.default_rng(seed)
    groups = []
    for index in range(count):
        group = random_group(rng, n=4, k=8, vocab_size=VOCAB, max_new_tokens=12)
        prompt = group.prompt_token_ids[: int(rng.integers(3, 14))]
        rewards = [0.0] * 4 if index % 4 == 1 else [float(r) for r in rng.integers(0, 2, size=4)]
        sampling = group.sampling.model_copy(update={"temperature": temperatures[index % len(temperatures)]})
        groups.append(
            group.model_copy(update={"prompt_token_ids": prompt, "rewards": rewards, "sampling": sampling})
        )
    return groups


def _targets(mb: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return sorted(mb[mask].tolist())


def test_packed_rows_hold_every_target_once_with_positions_from_zero() -> None:
    samples = samples_from_groups(_groups(0, temperatures=(1.0, 0.5)))
    padded, packed = collate(samples, pad_id=0), pack(samples, pad_id=0, row_length=48)
    assert packed.input_ids.shape[0] < padded.input_ids.shape[0] // 2  # answers of ≤ 25 tokens, rows of 48
    assert packed.input_ids.shape[1] <= 48 and packed.position_ids is not None
    assert packed.num_tokens == padded.num_tokens
    assert int(packed.attention_mask.sum()) == int(padded.attention_mask.sum())
    for name in ("rollout_logp", "advantages"):
        assert _targets(getattr(packed, name), packed.mask) == _targets(getattr(padded, name), padded.mask)
    # Position ids restart at 0 once per sample (and once for a row's padding), and only there.
    starts = int((packed.position_ids == 0).sum())
    padded_rows = int((packed.attention_mask[:, -1] == 0).sum())
    assert starts == len(samples) + padded_rows
    # Rows of each temperature (a row is of one: `pack`).
    assert set(packed.temperature.flatten().tolist()) == {1.0, 0.5}


def test_a_packed_forward_gives_each_token_the_log_prob_of_its_own_row(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Attention does not cross samples: the log-prob and entropy of every generated token are those of
    the sample alone in a padded row."""
    trainer = one_rank(settings(tiny_model_dir, tmp_path))
    model = trainer.engine.module
    samples = samples_from_groups(_groups(1))
    padded, packed = collate(samples, pad_id=0), pack(samples, pad_id=0, row_length=64)
    assert packed.input_ids.shape[0] < len(samples) // 2
    with torch.no_grad():
        logp_pad, entropy_pad = token_logp_and_entropy(model, padded)
        logp_pack, entropy_pack = token_logp_and_entropy(model, packed)
    # The same targets in another order: compare each sample's own values, matched by its rollout_logp.
    pad = sorted(zip(padded.rollout_logp[padded.mask].tolist(), logp_pad[padded.mask].tolist(), strict=True))
    got = sorted(zip(packed.rollout_logp[packed.mask].tolist(), logp_pack[packed.mask].tolist(), strict=True))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(pad), atol=1e-5, rtol=1e-5)
    assert sorted(entropy_pack[packed.mask].tolist()) == pytest.approx(
        sorted(entropy_pad[padded.mask].tolist()), abs=1e-5
    )


CASES: dict[str, tuple[list[str], tuple[float, ...]]] = {  # the settings, the groups' temperatures
    "lp_reg, one micro-batch": (
        ["learner.loss.name=lp_reg", "learner.loss.rho=0.3", "learner.micro_batch_tokens=100000"],
        (1.0,),
    ),
    "lp_reg, several micro-batches": (["learner.loss.name=lp_reg", "learner.loss.rho=0.3"], (1.0,)),
    "lp_reg with a KL to the reference": (
        ["learner.loss.name=lp_reg", "learner.loss.rho=0.3", "learner.kl.coef=0.1"],
        (1.0,),
    ),
    "grpo, A = 0 work skipped off": (["learner.loss.name=grpo", "learner.skip_zero_advantage=false"], (1.0,)),
    "kl_cov, two temperatures": (["learner.loss.name=kl_cov"], (1.0, 0.8)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_packing_leaves_the_gradient_unchanged(
    case: str,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    overrides, temperatures = CASES[case]
    base = ["learner.micro_batch_tokens=300", "learner.lr=1e-3", "learner.proxy_kappa=0.5"]
    trainer = one_rank(settings(tiny_model_dir, tmp_path, *base, *overrides))
    groups = _groups(2, temperatures=temperatures)
    padded_grads, padded = gradient_and_stats(trainer, groups, pack_length=None)
    packed_grads, packed = gradient_and_stats(trainer, groups, pack_length=64)

    assert packed["padding_share"] < padded["padding_share"]  # it packed
    assert packed["tokens"] == padded["tokens"] and packed["skipped_tokens"] == padded["skipped_tokens"]
    assert packed["micro_batches"] == padded["micro_batches"]  # the same micro-batches, packed
    assert_same_gradient(packed_grads, padded_grads)
    assert packed["loss"] == pytest.approx(padded["loss"], abs=1e-6)
    assert packed["entropy"] == pytest.approx(padded["entropy"], abs=1e-5)
    if trainer.cfg.loss.name == "lp_reg":  # the same micro-batches, so the same k and tokens regularized
        assert packed["reg_tokens"] == padded["reg_tokens"] > 0
        parts = partition(samples_from_groups(groups), trainer.cfg.micro_batch_tokens)
        assert len(parts) == 1 if "one micro-batch" in case else len(parts) > 1


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["learner.loss.name=gspo"], "gspo averages over each row"),
        (["learner.loss_aggregation=seq_mean_token_mean"], "use token_mean or unset pack_length"),
    ],
)
def test_packing_is_refused_where_a_row_must_be_one_sequence(overrides: list[str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        load_settings("smoke", ["learner.pack_length=256", *overrides])
