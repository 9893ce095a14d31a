"""LoRA on the learner (`learner.lora`, services/learner/lora.py), under real DeepSpeed through the product's
`run_updates`: the adapter's gradient is a hand-built LoRA forward's, the base never moves, what leaves the
learner is the adapter alone (a worker merges it into its base) or the merged model, and a checkpoint
holds the adapter in peft's format, the merged model in Hugging Face format and resumes exactly."""

from __future__ import annotations

from pathlib import Path

import deepspeed
import numpy as np
import pytest
import torch
from _learner import assert_same_gradient, gradient_and_stats, one_rank, settings
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from transformers import AutoModelForCausalLM

from sparkrl.proto import TrajectoryGroup
from sparkrl.proto.testing import random_group
from sparkrl.services.common.modeling import load_model, load_tokenizer
from sparkrl.services.common.settings import TorchEngineSettings
from sparkrl.services.common.settings.roles import LearnerConfig
from sparkrl.services.common.weight_sync import weights_checksum
from sparkrl.services.learner.checkpoint import ADAPTER_DIR, restore
from sparkrl.services.learner.ledger import Batch
from sparkrl.services.learner.lora import base_checksum, lora_layers
from sparkrl.services.learner.state import TrainState
from sparkrl.services.learner.trainer import OneRank, build_engine, learner_model
from sparkrl.services.rollout.engine import WeightLoadFailed
from sparkrl.services.rollout.install import VersionInstaller
from sparkrl.services.rollout.torch_engine import TorchEngine

peft = pytest.importorskip(
    "peft", reason="the lora extra (peft) is not installed: pip install 'sparkrl[lora]'"
)

VOCAB = 260  # the tiny model's byte-level vocabulary
RANK, ALPHA = 4, 8.0
LORA = [f"learner.lora.r={RANK}", f"learner.lora.alpha={ALPHA}", "learner.lr=1e-3"]


def _groups(seed: int, count: int = 4) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(seed)
    groups = []
    for _ in range(count):
        group = random_group(rng, n=4, k=8, vocab_size=VOCAB, max_new_tokens=12)
        prompt = group.prompt_token_ids[: int(rng.integers(6, 14))]
        groups.append(group.model_copy(update={"prompt_token_ids": prompt, "rewards": [1.0, 0.0, 0.0, 1.0]}))
    return groups


def _nonzero_b(module: torch.nn.Module, seed: int = 0) -> None:
    """peft starts B at 0, where A's gradient is 0 too: a B of its own makes both gradients tell."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(module).values():
            weight = layer.lora_B["default"].weight
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.05)


class HandLoRA(torch.nn.Module):
    """y = x W0ᵀ + b + (alpha / r) (x Aᵀ) Bᵀ, written out: the layer peft's is checked against."""

    def __init__(self, base: torch.nn.Linear, a: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = torch.nn.Parameter(a.clone())
        self.b = torch.nn.Parameter(b.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (ALPHA / RANK) * torch.nn.functional.linear(
            torch.nn.functional.linear(x, self.a), self.b
        )


def _hand_built(model_dir: Path, lora_module: torch.nn.Module) -> torch.nn.Module:
    """The base model with each of `lora_module`'s LoRA layers replaced by a HandLoRA of the same A and B."""
    model = load_model(model_dir).requires_grad_(False)
    for name, layer in lora_layers(lora_module).items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
        setattr(parent, leaf, HandLoRA(getattr(parent, leaf), a, b))
    return model


def test_the_adapters_gradient_is_a_hand_built_loras(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    cfg = settings(tiny_model_dir, tmp_path / "run", *LORA)
    trainer = one_rank(cfg)
    module = trainer.engine.module
    _nonzero_b(module)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)  # the optimizer's, alone
    assert len(trainer.engine.optimizer.param_groups[0]["params"]) == len(names)

    hand_model = _hand_built(tiny_model_dir, module)
    hand = OneRank(
        build_engine(hand_model, cfg.learner), load_tokenizer(tiny_model_dir), cfg.learner, tmp_path
    )
    groups = _groups(0)
    got, stats = gradient_and_stats(trainer, groups)
    want, hand_stats = gradient_and_stats(hand, groups)
    assert_same_gradient(got, want)  # atol 1e-6, rtol 1e-5: the same float32 arithmetic, summed otherwise
    assert stats["loss"] == pytest.approx(hand_stats["loss"], rel=1e-5)
    assert all(float(g.abs().max()) > 0 for g in got)  # A's gradients too, B being non-zero


def _trained(tiny_model_dir: Path, run: Path, *extra: str) -> tuple[OneRank, torch.nn.Module]:  # noqa: F811
    """Three steps of LoRA; the base checked bit-identical (weight decay on: not optimized), B moved."""
    cfg = settings(tiny_model_dir, run, *LORA, "learner.weight_decay=0.1", *extra)
    trainer = one_rank(cfg)
    module = trainer.engine.module
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    adapter = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    for step in (1, 2, 3):
        trainer.update(Batch(groups=_groups(step), entries=[]), step, cfg.learner)
    for name, param in module.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), f"{name} moved"
    assert any(not torch.equal(p, adapter[n]) for n, p in module.named_parameters() if n in adapter)
    return trainer, module


def _same_logits(model: torch.nn.Module, module: torch.nn.Module) -> None:
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, module(ids).logits, atol=5e-5, rtol=1e-5)


def test_the_base_stays_bit_identical_and_the_merged_model_leaves_the_learner(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    trainer, module = _trained(tiny_model_dir, tmp_path / "run", "learner.lora.sync=merged")
    assert trainer.adapter_base is None
    merged = trainer.weights()
    base = load_model(tiny_model_dir)
    assert set(merged) == set(base.state_dict())  # the base's names: a worker needs no LoRA
    for name, layer in lora_layers(module).items():
        a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
        w0 = layer.base_layer.weight.detach()
        torch.testing.assert_close(merged[f"{name}.weight"], w0 + (ALPHA / RANK) * b @ a, atol=1e-6, rtol=0)
    base.load_state_dict(merged)
    _same_logits(base, module)


def test_the_adapter_alone_leaves_the_learner_and_a_worker_merges_it_into_its_base(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """`learner.lora.sync: adapter` (the default): a version is r · (in + out) numbers per layer; the
    worker's installer merges it into the base it loaded and then samples from the learner's model; a
    worker on another base refuses it, naming why, and keeps its weights."""
    trainer, module = _trained(tiny_model_dir, tmp_path / "run")
    version = trainer.weights()
    layers = lora_layers(module)
    assert set(version) == {f"{n}{part}" for n in layers for part in (".lora_A", ".lora_B")}
    base_bytes = sum(t.numel() * t.element_size() for t in load_model(tiny_model_dir).state_dict().values())
    sent = sum(t.numel() * t.element_size() for t in version.values())
    assert sent < base_bytes / 4
    assert trainer.adapter_base is not None

    engine = TorchEngine(tiny_model_dir, TorchEngineSettings(dtype="float32"))
    installer = VersionInstaller(engine, tiny_model_dir)
    installer.install(version, 3, trainer.adapter_base)
    assert engine.policy_version == 3
    assert installer.checksum() == weights_checksum(version.items())  # the announced one, held
    _same_logits(engine.model, module)

    other = load_model(tiny_model_dir)
    with torch.no_grad():
        other.get_submodule(next(iter(layers))).weight.add_(0.01)  # an adapted layer's base differs
    moved = tmp_path / "other-base"
    other.save_pretrained(moved)
    before = weights_checksum(engine.model.state_dict().items())
    stranger = VersionInstaller(engine, moved)
    with pytest.raises(WeightLoadFailed, match=r"base model .* is not the learner's"):
        stranger.install(version, 4, trainer.adapter_base)
    assert weights_checksum(engine.model.state_dict().items()) == before and engine.policy_version == 3


def test_a_checkpoint_holds_the_adapter_and_the_merged_model_and_resumes_exactly(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    cfg = settings(tiny_model_dir, tmp_path / "run", *LORA)
    trainer = one_rank(cfg)
    for step in (1, 2):
        trainer.update(Batch(groups=_groups(step), entries=[]), step, cfg.learner)
    path = trainer.save(TrainState(step=2, policy_version=2), None)
    module = trainer.engine.module
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = module(ids).logits

        exported = AutoModelForCausalLM.from_pretrained(path / "hf")  # as without LoRA
        torch.testing.assert_close(exported(ids).logits, want, atol=1e-5, rtol=1e-5)
        with_adapter = peft.PeftModel.from_pretrained(load_model(tiny_model_dir), str(path / ADAPTER_DIR))
        torch.testing.assert_close(with_adapter(ids).logits, want, atol=1e-5, rtol=1e-5)

    def fresh() -> object:
        return build_engine(learner_model(cfg.model, cfg.learner), cfg.learner)

    engine, state, restored = restore(fresh(), Path(cfg.run_dir), fresh)
    assert restored is not None and state is not None and state.step == 2
    for (name, mine), (_, theirs) in zip(
        module.named_parameters(), engine.module.named_parameters(), strict=True
    ):
        assert torch.equal(mine, theirs), name
    for mine, theirs in zip(
        trainer.engine.optimizer.param_groups[0]["params"],
        engine.optimizer.param_groups[0]["params"],
        strict=True,
    ):
        state_mine, state_theirs = trainer.engine.optimizer.state[mine], engine.optimizer.state[theirs]
        assert torch.equal(state_mine["exp_avg"], state_theirs["exp_avg"])


def test_lora_gives_the_same_adapter_under_every_zero_stage(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Two updates under ZeRO 0, 2 and 3: ZeRO-2 gives ZeRO-0's adapter bit for bit; ZeRO-3 (its frozen
    output layer's logits in one call per micro-batch instead of checkpointed chunks: logprobs.py) within
    float32 rounding. The base stays bit-identical to the model's under each."""
    versions, bases = [], []
    for stage in (0, 2, 3):
        cfg = settings(tiny_model_dir, tmp_path / f"run{stage}", *LORA, f"learner.zero_stage={stage}")
        trainer = one_rank(cfg)
        for step in (1, 2):
            trainer.update(Batch(groups=_groups(step), entries=[]), step, cfg.learner)
        versions.append(trainer.weights())
        module = trainer.engine.module  # type: ignore[attr-defined]
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            assert base_checksum(module) == trainer.adapter_base, f"ZeRO-{stage} changed the base"
        bases.append(trainer.adapter_base)
        if stage == 3:  # resumed exactly: the next update from the checkpoint is the one without a stop
            _resumes_exactly(trainer, cfg)
    assert set(versions[0]) == set(versions[1]) == set(versions[2])
    assert any(t.abs().sum() > 0 for n, t in versions[0].items() if n.endswith("lora_B"))  # B starts at 0
    assert all(torch.equal(versions[0][name], versions[1][name]) for name in versions[0])
    # Each Adam step moves a weight by ~lr = 1e-3 whatever its gradient's size, so the float32 rounding of a
    # near-zero gradient shows in the update (measured: 3e-6 at most, 1 element of 512): 1e-5 = 1% of a step.
    for name in versions[0]:
        torch.testing.assert_close(versions[2][name], versions[0][name], atol=1e-5, rtol=0)
    assert bases[0] == bases[1] == bases[2]


def _resumes_exactly(trainer: OneRank, cfg: LearnerConfig) -> None:
    """Save, restore into a fresh engine, take the same third update on both: the same adapter, bit for
    bit (the weights and the optimizer's state came back whole, gathered or partitioned)."""
    trainer.save(TrainState(step=2, policy_version=2), None)

    def fresh() -> object:
        return build_engine(learner_model(cfg.model, cfg.learner), cfg.learner)

    engine, state, restored = restore(fresh(), Path(cfg.run_dir), fresh)
    assert restored is not None and state is not None and state.step == 2
    resumed = OneRank(engine, trainer.tokenizer, cfg.learner, Path(cfg.run_dir))
    for one in (trainer, resumed):
        one.update(Batch(groups=_groups(3), entries=[]), 3, cfg.learner)
    went_on, came_back = trainer.weights(), resumed.weights()
    assert all(torch.equal(went_on[name], came_back[name]) for name in went_on)
