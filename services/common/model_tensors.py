"""A model's tensors in the two layouts that meet in a weight update, from a local Hugging Face directory.

- *As sent*: the learner's `state_dict()` as transformers holds it in memory, each tied tensor once
  (`weight_sync.distinct_tensors`: a tied head goes as its embedding). What the learner broadcasts, a
  snapshot holds, the torch engine loads, and the announced checksum covers.
- *As stored*: the checkpoint's own names and layout, what `save_pretrained` writes and vLLM's loaders
  read. Transformers 5 converts some tensors on load (a mixture of experts' per-expert weights fused into
  one tensor per layer: Qwen3-MoE's `mlp.experts.gate_up_proj`); `to_checkpoint_format` reverts that with
  transformers' own `revert_weight_conversion`, as `save_pretrained` does. For most families the two are
  the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from sparkrl.services.common.weight_sync.manifest import distinct_tensors, tied_aliases


def meta_model(model_path: Path) -> PreTrainedModel:
    """The Hugging Face model built from its config on the meta device: names, shapes, ties, no weights."""
    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def model_skeleton(model_path: Path) -> dict[str, torch.Tensor]:
    """The model's tensors as sent, on the meta device (a tied head left out); `tied_names` gives the
    aliases."""
    return distinct_tensors(meta_model(model_path).state_dict(keep_vars=True))


def tied_names(model_path: Path) -> dict[str, str]:
    """Each tied alias of the model (`lm_head.weight` of a tied head) → the name its tensor is sent under.
    The parameters themselves (keep_vars): on the meta device a tied one is told apart only as one object."""
    return tied_aliases(meta_model(model_path).state_dict(keep_vars=True).items())


def to_checkpoint_format(
    model: PreTrainedModel, tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`tensors` as sent → as stored (`model`: the family's, `meta_model` will do). The same dict when the
    family converts nothing."""
    from transformers.core_model_loading import revert_weight_conversion

    stored = revert_weight_conversion(model, dict(tensors))
    return dict(tensors) if stored.keys() == tensors.keys() else stored


def checkpoint_state_dict(model_path: Path) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as sent, in state-dict order (the learner's broadcast of its first
    version): read from the safetensors files on CPU, or, for a family whose layout transformers converts
    on load, through `from_pretrained` (its own dtype)."""
    from safetensors import safe_open

    live = meta_model(model_path).state_dict(keep_vars=True)
    stored: dict[str, torch.Tensor] = {}
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as shard:
            stored.update({name: shard.get_tensor(name) for name in shard.keys()})
    # A tied weight (lm_head sharing embed_tokens) is stored once, under one of its names.
    stored_name = {id(tensor): name for name, tensor in live.items() if name in stored}
    sent = distinct_tensors(live)
    if all(id(tensor) in stored_name for tensor in sent.values()):
        return [(name, stored[stored_name[id(tensor)]]) for name, tensor in sent.items()]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto", local_files_only=True)
    return list(distinct_tensors(model.state_dict()).items())
