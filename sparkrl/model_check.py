"""`sparkrl check`'s look at the model directory against what the settings ask of it (sparkrl/preflight.py
turns each finding into a line naming the setting and the fix).

- the tokenizer files are there (tokenizer_config.json, and tokenizer.json or a slow tokenizer's
  vocabulary) and the tokenizer loads;
- its vocabulary fits the model: `len(tokenizer)` ids no larger than the config's `vocab_size` (the
  embedding's rows);
- prompts render as `rollout.chat_template`, `chat_template_kwargs` and `system_prompt` ask: one sample
  prompt through `modeling.render_prompt`, the workers' own rendering;
- `rollout.eos_tokens` are tokens of the vocabulary (`modeling.stop_token_ids`, as both engines resolve them).

Cheap where it can be: a directory whose chat template nothing asks for is read with the `tokenizers`
library alone (no transformers import, ~4 s); a chat template, a system prompt or stop tokens need the
tokenizer the workers load (transformers' AutoTokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparkrl.services.common.settings import RolloutSettings

# Where a Hugging Face directory keeps its chat template, besides tokenizer_config.json's `chat_template`.
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")
# A tokenizer's vocabulary: the fast one's file, or a slow one's (SentencePiece, BPE, WordPiece).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
COPY_FIX = (
    "copy the tokenizer files from the model it was trained from (a checkpoint saved without them: "
    "tokenizer.save_pretrained(DIR))"
)

Finding = tuple[str, str]  # (setting, what is wrong and the fix)
RENDERING = ("rollout.chat_template", "rollout.chat_template_kwargs", "rollout.system_prompt")  # its findings


def has_chat_template(path: Path) -> bool:
    """Whether the directory's files hold a chat template (read without loading the tokenizer)."""
    if any((path / name).exists() for name in TEMPLATE_FILES):
        return True
    config = path / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def needs_full_tokenizer(path: Path, rollout: RolloutSettings) -> bool:
    """Whether the check must load transformers' tokenizer: a template that may be in force, a system
    prompt, stop tokens to resolve, or no tokenizer.json for the `tokenizers` library to read."""
    template = rollout.chat_template == "on" or (rollout.chat_template == "auto" and has_chat_template(path))
    asked = rollout.system_prompt is not None or rollout.eos_tokens is not None
    return template or asked or not (path / "tokenizer.json").is_file()


def load(path: Path, rollout: RolloutSettings) -> tuple[list[Finding], Any]:
    """(findings, the tokenizer): transformers' as the workers load it where the settings need it, else the
    fast `tokenizers` one; None when the files are missing or it does not load."""
    has_config = (path / "tokenizer_config.json").is_file()
    has_vocabulary = any((path / name).is_file() for name in VOCABULARY_FILES)
    if not (has_config and has_vocabulary):
        missing = [] if has_vocabulary else ["tokenizer.json (nor a slow tokenizer's vocabulary)"]
        missing += [] if has_config else ["tokenizer_config.json (its special tokens, its chat template)"]
        return [("model", f"{path} has no {' and no '.join(missing)}: {COPY_FIX}")], None
    try:
        if needs_full_tokenizer(path, rollout):
            from sparkrl.services.common.modeling import load_tokenizer

            return [], load_tokenizer(path)
        from tokenizers import Tokenizer

        return [], Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:  # whatever the tokenizer files say is wrong, said once
        return [("model", f"the tokenizer in {path} does not load ({exc}): {COPY_FIX}"[:600])], None


def vocabulary_size(tokenizer: Any) -> int:
    """Ids the tokenizer can produce: `len()` of transformers' tokenizer, added tokens counted alike."""
    if hasattr(tokenizer, "get_vocab_size"):  # the `tokenizers` library's
        return int(tokenizer.get_vocab_size(with_added_tokens=True))
    return len(tokenizer)


def embedding_rows(config: dict[str, Any]) -> int | None:
    """The config's vocab_size (a multimodal config keeps its language model's in `text_config`)."""
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if size else None


def findings(
    path: Path, config: dict[str, Any], tokenizer: Any, rollout: RolloutSettings, sample: str | None
) -> list[Finding]:
    """What the model directory cannot do as the settings ask, each with its fix; `sample`: a prompt of
    the data to render (None: `modeling.SAMPLE_PROMPT`)."""
    found: list[Finding] = []
    rows, size = embedding_rows(config), vocabulary_size(tokenizer)
    if rows is not None and size > rows:
        found.append(
            (
                "model",
                f"the tokenizer in {path} has {size} tokens and the model's embedding {rows} rows "
                "(config.json vocab_size): ids past it would index outside the embedding; resize it "
                "(model.resize_token_embeddings(len(tokenizer)), then save_pretrained) or use the tokenizer "
                "the model was trained with",
            )
        )
    if hasattr(tokenizer, "get_vocab_size"):  # nothing asked needs the full tokenizer: no more to check
        return found
    from sparkrl.services.common.modeling import (
        SAMPLE_PROMPT,
        check_prompt_format,
        generation_eos_ids,
        stop_token_ids,
    )

    problem = check_prompt_format(tokenizer, rollout.prompt_format, sample or SAMPLE_PROMPT)
    if problem is not None:
        found.append(problem)
    try:
        stop_token_ids(tokenizer, generation_eos_ids(path), rollout.eos_tokens)
    except ValueError as exc:
        found.append(("rollout.eos_tokens", str(exc).removeprefix("rollout.eos_tokens: ")))
    return found
