"""Model and tokenizer loading from a local Hugging Face directory, shared by rollout and learner."""

from __future__ import annotations

import json
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

from sparkrl.services.common.settings import PromptFormat

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


TextOrMessages = str | Sequence[Mapping[str, str]]
SAMPLE_PROMPT = "What is 1 + 1?"  # rendered once at start: a format the model cannot render fails there


class PromptFormatError(ValueError):
    """Prompts cannot be rendered as the settings ask (`check_prompt_format` names the setting and fix)."""


def prompt_messages(text_or_messages: TextOrMessages, system_prompt: str | None) -> list[dict[str, str]]:
    """The prompt as chat messages (a text is one user turn), `system_prompt` first unless it has its own."""
    if isinstance(text_or_messages, str):
        messages = [{"role": "user", "content": text_or_messages}]
    else:
        messages = [dict(message) for message in text_or_messages]
    if system_prompt is not None and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def template_in_force(tokenizer: PreTrainedTokenizerBase, fmt: PromptFormat) -> bool:
    """Whether prompts go through the chat template: `off` never, `auto` when the tokenizer has one, `on`
    always (PromptFormatError when it has none)."""
    if fmt.chat_template == "off":
        return False
    if fmt.chat_template == "on" and not tokenizer.chat_template:
        raise PromptFormatError(f"rollout.chat_template is on, but {_where(tokenizer)} has no chat template")
    return bool(tokenizer.chat_template)


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, text_or_messages: TextOrMessages, fmt: PromptFormat
) -> list[int]:
    """Prompt token ids, the one rendering every caller shares (workers, evaluators, the launcher's checks):
    the messages (`prompt_messages`) through the chat template with the generation prompt and
    `fmt.chat_template_kwargs` when one is in force (`template_in_force`), else the plain text (the
    contents joined by newlines) with the tokenizer's own special tokens."""
    messages = prompt_messages(text_or_messages, fmt.system_prompt)
    if template_in_force(tokenizer, fmt):
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **fmt.chat_template_kwargs
        )
        # Encoded without extra specials: the template already writes BOS and friends.
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n".join(m["content"] for m in messages)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def apply_chat_template_if_any(
    tokenizer: PreTrainedTokenizerBase, text_or_messages: TextOrMessages
) -> list[int]:
    """`render_prompt` in the default format: the chat template when the tokenizer has one, no template
    variables, no system prompt."""
    return render_prompt(tokenizer, text_or_messages, PromptFormat())


def check_prompt_format(
    tokenizer: PreTrainedTokenizerBase, fmt: PromptFormat, sample: TextOrMessages = SAMPLE_PROMPT
) -> tuple[str, str] | None:
    """(setting, what is wrong and the fix) when `sample` does not render in `fmt` — `chat_template: on`
    without a template, a system message or variables the template refuses — else None."""
    where = _where(tokenizer)
    if fmt.chat_template == "on" and not tokenizer.chat_template:
        fix = "add one (tokenizer_config.json's chat_template, or chat_template.jinja), or set "
        return "rollout.chat_template", f"on, but {where} has no chat template: {fix}chat_template=off"
    said = _render_error(tokenizer, sample, fmt)
    if said is None:
        return None
    without_system = fmt.model_copy(update={"system_prompt": None})
    if fmt.system_prompt is not None and _render_error(tokenizer, sample, without_system) is None:
        fix = "unset it and put the instruction in prompts.template"
        said = f"the chat template of {where} refuses a system message ({said})"
        return "rollout.system_prompt", f"{said}: {fix}"
    without_kwargs = fmt.model_copy(update={"chat_template_kwargs": {}})
    if fmt.chat_template_kwargs and _render_error(tokenizer, sample, without_kwargs) is None:
        refused = json.dumps(fmt.chat_template_kwargs)
        said = f"the chat template of {where} refuses {refused} ({said})"
        return "rollout.chat_template_kwargs", f"{said}: fix or drop them"
    fix = "fix the template, or set it off (plain text)"
    return "rollout.chat_template", f"the chat template of {where} does not render a prompt ({said}): {fix}"


def describe_prompt_format(tokenizer: PreTrainedTokenizerBase, fmt: PromptFormat) -> str:
    """Which rendering is in force, in words (a worker logs it at start)."""
    system = ", with a system prompt" if fmt.system_prompt is not None else ""
    mode = f"rollout.chat_template {fmt.chat_template}"
    if template_in_force(tokenizer, fmt):
        kwargs = f", kwargs {json.dumps(fmt.chat_template_kwargs)}" if fmt.chat_template_kwargs else ""
        return f"prompts through the chat template ({mode}{kwargs}){system}"
    why = ": the tokenizer has none" if fmt.chat_template == "auto" else ""
    unused = "; chat_template_kwargs unused" if fmt.chat_template_kwargs else ""
    return f"prompts as plain text ({mode}{why}){system}{unused}"


def _render_error(
    tokenizer: PreTrainedTokenizerBase, sample: TextOrMessages, fmt: PromptFormat
) -> str | None:
    try:
        render_prompt(tokenizer, sample, fmt)
    except Exception as exc:  # whatever the template raises (jinja's errors, its raise_exception)
        return f"{type(exc).__name__}: {exc}"[:300]
    return None


def _where(tokenizer: PreTrainedTokenizerBase) -> str:
    return f"the tokenizer in {tokenizer.name_or_path}" if tokenizer.name_or_path else "the tokenizer"


def generation_eos_ids(model_path: str | Path) -> list[int]:
    """The end-of-sequence ids the model's generation config lists: generation_config.json's, else
    config.json's (as transformers' `model.generation_config` takes them)."""
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(model_path, local_files_only=True)
    except OSError:  # no generation_config.json
        model_config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        config = GenerationConfig.from_model_config(model_config)
    return _id_list(config.eos_token_id)


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    configured: int | list[int] | None,
    eos_tokens: Sequence[str | int] | None,
) -> list[int]:
    """The ids that end a completion, sorted, for both engines alike: `eos_tokens` (`rollout.eos_tokens`:
    token strings as the vocabulary spells them, or ids) exactly when given, else `configured` (the
    generation config's eos ids) plus the tokenizer's EOS. ValueError names a string the vocabulary lacks
    or an id past it."""
    if eos_tokens is None:
        return sorted(set(_id_list(configured)) | set(_id_list(tokenizer.eos_token_id)))
    vocab, size = tokenizer.get_vocab(), len(tokenizer)
    ids = set()
    for token in eos_tokens:
        found = token if isinstance(token, int) else vocab.get(token)
        if found is None or not 0 <= found < size:
            what = "is past the vocabulary of" if isinstance(token, int) else "is not a token of"
            specials = ", ".join(repr(t) for t in tokenizer.all_special_tokens[:12])
            raise ValueError(
                f"rollout.eos_tokens: {token!r} {what} {_where(tokenizer)} ({size} tokens; its special "
                f"tokens: {specials}): spell each as the vocabulary does, or give its id"
            )
        ids.add(found)
    return sorted(ids)


def chat_format_at_start(
    model_path: str | Path, fmt: PromptFormat, eos_tokens: Sequence[str | int] | None
) -> str:
    """What a worker or evaluator says at start: how prompts are rendered and which tokens end a
    completion. ValueError ("setting: what is wrong and the fix") when the model cannot do as the settings
    ask, so it stops before its engine starts, not on every prompt."""
    tokenizer = load_tokenizer(model_path)
    problem = check_prompt_format(tokenizer, fmt)
    if problem is not None:
        raise PromptFormatError("{}: {}".format(*problem))
    stops = stop_token_ids(tokenizer, generation_eos_ids(model_path), eos_tokens)
    tokens = tokenizer.convert_ids_to_tokens(stops)
    named = ", ".join(f"{token} ({i})" for i, token in zip(stops, tokens, strict=True))
    source = "rollout.eos_tokens" if eos_tokens is not None else "the generation config and the tokenizer"
    return f"{describe_prompt_format(tokenizer, fmt)}; completions end at {named or 'no token'} ({source})"


def _id_list(ids: int | list[int] | None) -> list[int]:
    return [int(i) for i in (ids if isinstance(ids, list) else [ids]) if i is not None]
