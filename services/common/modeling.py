"""Model and tokenizer loading from a local Hugging Face directory, shared by rollout and learner."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from sparkrl.services.common.weight_sync.manifest import distinct_tensors, tied_aliases

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"bfloat16"` → torch.bfloat16; a torch.dtype passes through."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _local_dir(path: str | Path) -> Path:
    directory = Path(path)
    if not (directory / "config.json").is_file():
        # Fail here with the path, rather than let from_pretrained treat it as a hub id.
        raise FileNotFoundError(f"{directory} is not a Hugging Face model directory (no config.json)")
    return directory


def load_model(
    path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu", attention: str | None = None
) -> PreTrainedModel:
    """A causal LM in eval mode on `device`; local files only (never a hub download). `attention`: the
    attention kernel (transformers' attn_implementation), None for the model's default."""
    extra = {"attn_implementation": attention} if attention else {}
    model = AutoModelForCausalLM.from_pretrained(
        _local_dir(path), dtype=resolve_dtype(dtype), local_files_only=True, **extra
    )
    return model.to(device).eval()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The model's tokenizer; local files only. A missing pad token falls back to EOS (batching needs one)."""
    tokenizer = AutoTokenizer.from_pretrained(_local_dir(path), local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def apply_chat_template_if_any(
    tokenizer: PreTrainedTokenizerBase, text_or_messages: str | Sequence[Mapping[str, str]]
) -> list[int]:
    """Prompt token ids: through the chat template (with the generation prompt) when the tokenizer has one,
    else the plain text (messages' contents joined by newlines) with the tokenizer's own special tokens."""
    if isinstance(text_or_messages, str):
        messages = [{"role": "user", "content": text_or_messages}]
    else:
        messages = [dict(message) for message in text_or_messages]
    if tokenizer.chat_template:
        # Render to text, then encode without extra specials: the template already writes BOS and friends.
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = (
        text_or_messages if isinstance(text_or_messages, str) else "\n".join(m["content"] for m in messages)
    )
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def model_skeleton(model_path: Path) -> dict[str, torch.Tensor]:
    """The Hugging Face model's distinct tensors on the meta device (names and shapes, a tied head left
    out: `weight_sync.distinct_tensors`), no weights; `tied_names(model_path)` gives the aliases."""
    return distinct_tensors(_meta_state_dict(model_path))


def tied_names(model_path: Path) -> dict[str, str]:
    """Each tied alias of the model (`lm_head.weight` of a tied head) → the name its tensor is sent under."""
    return tied_aliases(_meta_state_dict(model_path).items())


def _meta_state_dict(model_path: Path) -> dict[str, torch.Tensor]:
    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return skeleton.state_dict(keep_vars=True)  # parameters themselves: a tied one is one object


def checkpoint_state_dict(model_path: Path) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's distinct tensors in the Hugging Face model's state-dict order (the learner's
    broadcast: a tied head once, under its embedding's name), read from the safetensors files on CPU."""
    from safetensors import safe_open

    live = _meta_state_dict(model_path)
    stored: dict[str, torch.Tensor] = {}
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as shard:
            stored.update({name: shard.get_tensor(name) for name in shard.keys()})
    # A tied weight (lm_head sharing embed_tokens) is stored once, under one of its names.
    stored_name = {id(tensor): name for name, tensor in live.items() if name in stored}
    return [(name, stored[stored_name[id(tensor)]]) for name, tensor in distinct_tensors(live).items()]
