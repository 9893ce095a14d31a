"""A model's tensors as sent and as stored (services/common/model_tensors.py).

A tied output layer (the head is the embedding) travels once, under its embedding's name: the learner's
published weights, the checkpoint's tensors a vLLM worker restores, the LoRA merge and the torch engine's
checksum all agree on that, and the torch engine's head follows its embedding. A family whose layout
transformers converts on load (Qwen3-MoE's fused experts) goes back to its checkpoint's layout for vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _families import build_family
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from transformers import AutoModelForCausalLM

from sparkrl.services.common.model_tensors import (
    checkpoint_state_dict,
    meta_model,
    model_skeleton,
    tied_names,
    to_checkpoint_format,
)
from sparkrl.services.common.modeling import load_model
from sparkrl.services.common.settings import TorchEngineSettings
from sparkrl.services.common.weight_sync import distinct_tensors, tied_aliases, weights_checksum
from sparkrl.services.rollout.torch_engine import TorchEngine

HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def tied_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """The tiny model with `tie_word_embeddings` (its checkpoint stores the embedding alone)."""
    source = load_model(tiny_model_dir)
    source.config.tie_word_embeddings = True
    tied = AutoModelForCausalLM.from_config(source.config)
    tied.load_state_dict({k: v for k, v in source.state_dict().items() if k != HEAD}, strict=False)
    out = tmp_path_factory.mktemp("tied")
    tied.save_pretrained(out, safe_serialization=True)
    for file in tiny_model_dir.glob("*token*"):
        (out / file.name).write_bytes(file.read_bytes())
    return out


def test_a_tied_head_is_an_alias_of_its_embedding_and_is_left_out(tied_dir: Path) -> None:
    model = load_model(tied_dir)
    state = model.state_dict()
    assert tied_aliases(state.items()) == {HEAD: EMBEDDING}
    distinct = distinct_tensors(state)
    assert HEAD not in distinct and EMBEDDING in distinct
    assert list(distinct) == [name for name in state if name != HEAD]  # the state dict's order kept
    # Copies are separate tensors: nothing is taken for an alias, so dedupe before copying.
    assert tied_aliases((n, t.clone()) for n, t in state.items()) == {}
    # On the meta device only the parameter objects tell a tied tensor apart.
    assert HEAD not in model_skeleton(tied_dir) and tied_names(tied_dir) == {HEAD: EMBEDDING}


def test_an_untied_model_keeps_every_name(tiny_model_dir: Path) -> None:  # noqa: F811
    state = load_model(tiny_model_dir).state_dict()
    assert tied_aliases(state.items()) == {} and list(distinct_tensors(state)) == list(state)
    assert tied_names(tiny_model_dir) == {}


def test_the_checkpoints_tensors_are_the_learners_broadcast(tied_dir: Path) -> None:
    """What a vLLM worker restores and checksums before its first update: the same names, order and
    bytes as a learner's published weights of the same model."""
    published = distinct_tensors(load_model(tied_dir).state_dict())
    stored = checkpoint_state_dict(tied_dir)
    assert [name for name, _ in stored] == list(published)
    assert weights_checksum(stored) == weights_checksum(published.items())


def test_the_torch_engines_head_follows_its_embedding(tied_dir: Path) -> None:
    engine = TorchEngine(tied_dir, TorchEngineSettings())
    try:
        sent = {
            n: t + 0.01 * torch.randn_like(t) for n, t in distinct_tensors(engine.model.state_dict()).items()
        }
        engine.load_weights(sent.items(), version=1)
        assert torch.equal(engine.model.lm_head.weight, sent[EMBEDDING])  # the head took the embedding's
        assert engine.weights_checksum() == weights_checksum(sent.items())  # over what was sent
    finally:
        engine.close()


def test_a_lora_merge_of_a_tied_model_sends_the_embedding_once(tied_dir: Path) -> None:
    from sparkrl.services.common.settings import LoraSettings
    from sparkrl.services.learner.lora import install_lora, merged_state_dict

    model = install_lora(load_model(tied_dir), LoraSettings(r=4, target_modules=["q_proj", "v_proj"]))
    merged = merged_state_dict(model)
    assert HEAD not in merged and EMBEDDING in merged
    assert list(merged) == list(distinct_tensors(load_model(tied_dir).state_dict()))


def test_fused_experts_go_back_to_the_checkpoints_layout(tmp_path: Path) -> None:
    """Qwen3-MoE: transformers 5 holds each layer's experts fused (`mlp.experts.gate_up_proj`); the
    checkpoint (and vLLM's loader) has them one by one. Reverted, the learner's tensors are the file's."""
    from safetensors.torch import load_file

    model_dir = build_family("qwen3_moe", tmp_path)
    sent = distinct_tensors(load_model(model_dir).state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in sent
    stored = to_checkpoint_format(meta_model(model_dir), sent)
    on_disk = load_file(str(model_dir / "model.safetensors"))
    assert stored.keys() == on_disk.keys() and all(torch.equal(stored[n], on_disk[n]) for n in on_disk)
    # The checkpoint's tensors as sent: what a vLLM worker restores and checksums before any update.
    assert weights_checksum(checkpoint_state_dict(model_dir)) == weights_checksum(sent.items())


def test_a_family_without_conversions_is_sent_as_stored(tied_dir: Path) -> None:
    sent = distinct_tensors(load_model(tied_dir).state_dict())
    assert to_checkpoint_format(meta_model(tied_dir), sent) == sent


def test_a_late_joiner_takes_a_tied_models_snapshot(tied_dir: Path, tmp_path: Path) -> None:
    """The learner's snapshot file (what a worker outside the broadcast loads) of a tied model holds the
    embedding once; a torch worker installs it, its head follows, and it reports the published checksum."""
    from sparkrl.services.learner.publisher import write_snapshot
    from sparkrl.services.rollout.catch_up import load_snapshot
    from sparkrl.services.rollout.install import VersionInstaller

    learner = load_model(tied_dir)
    with torch.no_grad():
        for tensor in learner.parameters():
            tensor.add_(0.01)
    published = {n: t.detach().clone() for n, t in distinct_tensors(learner.state_dict()).items()}
    path = write_snapshot(published, 4, tmp_path)
    engine = TorchEngine(tied_dir, TorchEngineSettings())
    try:
        assert load_snapshot(VersionInstaller(engine, tied_dir), str(path)) is not None
        assert engine.policy_version == 4
        assert engine.weights_checksum() == weights_checksum(published.items())
        assert torch.equal(engine.model.lm_head.weight, published[EMBEDDING])
    finally:
        engine.close()
