"""A tied output layer (the head is the embedding) travels once, under its embedding's name: the learner's
published weights, the checkpoint's tensors a vLLM worker restores, the LoRA merge and the torch engine's
checksum all agree on that, and the torch engine's head follows its embedding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from transformers import AutoModelForCausalLM

from sparkrl.services.common.modeling import (
    checkpoint_state_dict,
    load_model,
    model_skeleton,
    tied_names,
)
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
