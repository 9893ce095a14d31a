"""The learner's trainer under real DeepSpeed (gloo, one process), for every loss in the registry: two
steps on the tiny model, finite loss, every parameter changed; plus the batch layout it relies on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _learner import one_rank, settings
from _tiny import tiny_model_dir  # noqa: F401  (fixture)

from sparkrl.proto import TrajectoryGroup
from sparkrl.proto.testing import random_group
from sparkrl.services.common.losses import LOSSES as POLICY_LOSSES
from sparkrl.services.common.modeling import load_model
from sparkrl.services.learner.batch import micro_batches, samples_from_groups
from sparkrl.services.learner.checkpoint import latest_checkpoint
from sparkrl.services.learner.ledger import Batch
from sparkrl.services.learner.logprobs import token_logp_and_entropy
from sparkrl.services.learner.state import TrainState

VOCAB = 260  # the tiny model's byte-level vocabulary


def _groups(seed: int, count: int = 4) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(seed)
    groups = []
    for _ in range(count):
        group = random_group(rng, n=4, T=6, k=8, vocab_size=VOCAB)
        rewards = [1.0, 0.0, 1.0, 0.0]  # every group has signal: advantages ±1
        groups.append(
            group.model_copy(update={"prompt_token_ids": group.prompt_token_ids[:12], "rewards": rewards})
        )
    return groups


def test_batch_layout_aligns_targets_with_predicting_positions() -> None:
    (group,) = _groups(0, count=1)
    samples = samples_from_groups([group])
    (mb,) = micro_batches(samples, token_budget=10_000, pad_id=0)
    P, T = len(group.prompt_token_ids), 6
    row = [s.input_ids.tolist() for s in samples].index(mb.input_ids[0, : P + T].tolist())
    completion = group.completions[row]
    # Position j predicts token j+1: the mask starts at the last prompt position and covers T targets.
    assert mb.mask[0].nonzero().flatten().tolist() == list(range(P - 1, P - 1 + T))
    assert mb.input_ids[0, P : P + T].tolist() == completion.token_ids.tolist()
    torch.testing.assert_close(mb.rollout_logp[0, P - 1 : P - 1 + T], torch.from_numpy(completion.logprobs))
    # Rewards [1, 0, 1, 0]: mean 0.5, unbiased std √(1/3), so A = ±0.5·√3 ≈ ±0.866 on every target.
    torch.testing.assert_close(
        mb.advantages[mb.mask].abs(), torch.full((4 * T,), 0.5 * 3**0.5), atol=1e-5, rtol=0
    )


def test_micro_batches_respect_the_token_budget() -> None:
    samples = samples_from_groups(_groups(1))
    batches = micro_batches(samples, token_budget=64, pad_id=0)
    assert sum(mb.input_ids.shape[0] for mb in batches) == len(samples)
    assert all(mb.input_ids.numel() <= 64 or mb.input_ids.shape[0] == 1 for mb in batches)


def test_the_output_projection_runs_from_the_first_target_only_and_matches_the_full_pass(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    model = load_model(tiny_model_dir)
    (mb,) = micro_batches(samples_from_groups(_groups(2)), token_budget=10_000, pad_id=0)
    assert int(mb.mask.any(0).nonzero()[0]) > 0, "the prompt should leave positions to skip"
    logp, entropy = token_logp_and_entropy(model, mb, entropy_grad=False)
    full = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1].float()
    full_logp_all = torch.log_softmax(full / mb.temperature, dim=-1)
    want = full_logp_all.gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logp[mb.mask], want[mb.mask], atol=1e-5, rtol=1e-5)
    want_entropy = -(full_logp_all.exp() * full_logp_all).sum(-1)
    torch.testing.assert_close(entropy[mb.mask], want_entropy[mb.mask], atol=1e-5, rtol=1e-5)
    assert logp.shape == entropy.shape == mb.mask.shape
    assert logp.requires_grad and not entropy.requires_grad  # a measurement only, unless the loss needs it
    _, with_grad = token_logp_and_entropy(model, mb, entropy_grad=True)
    assert with_grad.requires_grad


def test_bf16_autocast_trains_close_to_float32(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    overrides = ["learner.lr=1e-3", "learner.autocast=bfloat16", "learner.attention=eager"]
    trainer = one_rank(settings(tiny_model_dir, tmp_path, *overrides))
    model = trainer.engine.module
    groups = _groups(3)
    batches = micro_batches(samples_from_groups(groups), 2048, pad_id=0)
    exact, _ = token_logp_and_entropy(model, batches[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed, _ = token_logp_and_entropy(model, batches[0])
    assert mixed.dtype == torch.float32  # log-probs are taken in float32 whatever the matmuls ran in
    # bf16 matmuls: a few per cent on the log-probs (more on rare tokens, whose log-probs are large).
    torch.testing.assert_close(mixed[batches[0].mask], exact[batches[0].mask], atol=0.05, rtol=0.05)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    stats = trainer.update(Batch(groups, []), 1, trainer.cfg).row()
    assert np.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    assert not [n for n, p in model.named_parameters() if torch.equal(p, before[n])]


@pytest.mark.parametrize("loss_name", sorted(POLICY_LOSSES))
def test_two_steps_change_every_parameter(loss_name: str, tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    overrides = [f"learner.loss.name={loss_name}", "learner.lr=1e-3", "learner.micro_batch_tokens=256"]
    trainer = one_rank(settings(tiny_model_dir, tmp_path, *overrides))
    before = {name: p.detach().clone() for name, p in trainer.engine.module.named_parameters()}
    for step in (1, 2):
        groups = _groups(10 + step)
        assert len(micro_batches(samples_from_groups(groups), 256, pad_id=0)) > 1, "accumulate, please"
        stats = trainer.update(Batch(groups, []), step, trainer.cfg).row()
        assert np.isfinite(stats["loss"]) and np.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0
    named = trainer.engine.module.named_parameters()
    unchanged = [name for name, p in named if torch.equal(p, before[name])]
    assert not unchanged, f"{loss_name}: parameters not updated: {unchanged}"


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero_stages_train_and_checkpoint(zero_stage: int, tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    trainer = one_rank(
        settings(tiny_model_dir, tmp_path, f"learner.zero_stage={zero_stage}", "learner.lr=1e-3")
    )
    before = trainer.weights()
    stats = trainer.update(Batch(_groups(20), []), 1, trainer.cfg).row()
    assert np.isfinite(stats["loss"])
    after = trainer.weights()
    assert after.keys() == before.keys()
    assert any(not torch.equal(after[name], before[name]) for name in after)
    path = trainer.save(TrainState(step=1, policy_version=1), tag=None)
    assert path == tmp_path / "checkpoints" / "step-000001" == latest_checkpoint(tmp_path)
    reloaded = load_model(path / "hf")
    torch.testing.assert_close(dict(reloaded.state_dict())["model.norm.weight"], after["model.norm.weight"])
