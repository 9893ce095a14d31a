"""What the model sees (issue 46, part 3): one rendering for every caller — the chat template or plain text
(`rollout.chat_template` auto / on / off), its variables (`rollout.chat_template_kwargs`), a system
prompt — and samples.jsonl showing the rendered prompt. Real tokenizers with real Jinja templates."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from _tiny import tiny_model_dir  # noqa: F401  (pytest fixture)
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from sparkrl.proto.testing import random_group
from sparkrl.services.common.modeling import (
    PromptFormatError,
    chat_format_at_start,
    check_prompt_format,
    describe_prompt_format,
    render_prompt,
)
from sparkrl.services.common.settings import PromptFormat, load_settings
from sparkrl.services.common.tiny_model import build_tokenizer
from sparkrl.services.learner.reporting import sample_rows

# Qwen3's shape: ChatML turns, and an empty think block when `enable_thinking` is false.
QWEN3_LIKE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{%- endif %}"
)
# gpt-oss's shape: the reasoning effort in the system turn, refused when it is not one it knows.
EFFORT = (
    "{%- if reasoning_effort is defined and reasoning_effort not in ['low', 'medium', 'high'] %}"
    "{{ raise_exception('unknown reasoning_effort ' ~ reasoning_effort) }}{% endif %}"
    "[system]Reasoning: {{ reasoning_effort | default('medium') }}"
    "{%- for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"
)
# Gemma's shape: no system role at all.
NO_SYSTEM = (
    "{%- if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{%- for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
)


def chat_tokenizer(template: str | None) -> PreTrainedTokenizerFast:
    """The tiny model's byte tokenizer with ChatML's markers as special tokens and `template`."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = template
    return tokenizer


def seen(tokenizer: PreTrainedTokenizerFast, prompt: object, **fmt: object) -> str:
    return tokenizer.decode(render_prompt(tokenizer, prompt, PromptFormat(**fmt)))  # type: ignore[arg-type]


def test_the_templates_variables_reach_it() -> None:
    tokenizer = chat_tokenizer(QWEN3_LIKE)
    thinking = "<|im_start|>user\n1+2<|im_end|>\n<|im_start|>assistant\n"
    assert seen(tokenizer, "1+2") == thinking
    off = seen(tokenizer, "1+2", chat_template_kwargs={"enable_thinking": False})
    assert off == thinking + "<think>\n\n</think>\n\n"
    effort = chat_tokenizer(EFFORT)
    assert seen(effort, "1+2") == "[system]Reasoning: medium[user]1+2[assistant]"
    low = seen(effort, "1+2", chat_template_kwargs={"reasoning_effort": "low"})
    assert low == "[system]Reasoning: low[user]1+2[assistant]"
    # The markers are single tokens: the template's text is encoded without extra specials.
    ids = render_prompt(tokenizer, "1", PromptFormat())
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_a_system_prompt_is_prepended_unless_the_prompt_has_its_own() -> None:
    tokenizer = chat_tokenizer(QWEN3_LIKE)
    said = seen(tokenizer, "1+2", system_prompt="Be brief.")
    assert said == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+2<|im_end|>\n<|im_start|>assistant\n"
    )
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "1+2"}]
    assert "Be brief." not in seen(tokenizer, own, system_prompt="Be brief.")
    assert "<|im_start|>system\nMine.<|im_end|>" in seen(tokenizer, own, system_prompt="Be brief.")
    plain = build_tokenizer()  # no template: the text and a newline
    assert seen(plain, "1+2", system_prompt="Be brief.") == "Be brief.\n1+2"
    assert seen(plain, "1+2") == "1+2"


def test_the_template_is_switched_auto_on_or_off(tmp_path: Path) -> None:
    chat_tokenizer(QWEN3_LIKE).save_pretrained(tmp_path / "chat")
    tokenizer = saved(tmp_path / "chat")  # as a worker loads it: the template from the files
    question = "Use 1 2 to make 3."
    assert seen(tokenizer, question).startswith("<|im_start|>user\n")  # auto: it has one
    assert seen(tokenizer, question, chat_template="on") == seen(tokenizer, question)
    off = render_prompt(tokenizer, question, PromptFormat(chat_template="off"))
    assert off == tokenizer(question)["input_ids"]  # a base model's plain text
    build_tokenizer().save_pretrained(tmp_path / "base")
    base = saved(tmp_path / "base")
    assert seen(base, question) == question  # auto without a template: plain text
    with pytest.raises(PromptFormatError, match=re.escape(f"{tmp_path / 'base'} has no chat template")):
        render_prompt(base, question, PromptFormat(chat_template="on"))
    setting, message = check_prompt_format(base, PromptFormat(chat_template="on")) or ("", "")
    assert setting == "rollout.chat_template" and str(tmp_path / "base") in message
    assert "chat_template=off" in message


def saved(path: Path) -> PreTrainedTokenizerFast:
    """A tokenizer saved alone, loaded from its directory (its path is what errors name)."""
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def test_what_the_template_refuses_names_the_setting_that_asked_it() -> None:
    refusing = chat_tokenizer(NO_SYSTEM)
    assert check_prompt_format(refusing, PromptFormat()) is None
    setting, message = check_prompt_format(refusing, PromptFormat(system_prompt="Be brief.")) or ("", "")
    assert setting == "rollout.system_prompt" and "System role not supported" in message
    effort = chat_tokenizer(EFFORT)
    bad = PromptFormat(chat_template_kwargs={"reasoning_effort": "extreme"})
    setting, message = check_prompt_format(effort, bad) or ("", "")
    assert setting == "rollout.chat_template_kwargs" and "unknown reasoning_effort extreme" in message
    assert (
        check_prompt_format(effort, PromptFormat(chat_template_kwargs={"reasoning_effort": "high"})) is None
    )


def test_the_worker_says_which_rendering_is_in_force() -> None:
    chat, plain = chat_tokenizer(QWEN3_LIKE), build_tokenizer()
    kwargs = PromptFormat(chat_template_kwargs={"enable_thinking": False})
    assert describe_prompt_format(chat, kwargs) == (
        'prompts through the chat template (rollout.chat_template auto, kwargs {"enable_thinking": false})'
    )
    assert describe_prompt_format(chat, PromptFormat(chat_template="off")) == (
        "prompts as plain text (rollout.chat_template off)"
    )
    assert describe_prompt_format(plain, kwargs) == (
        "prompts as plain text (rollout.chat_template auto: the tokenizer has none); chat_template_kwargs "
        "unused"
    )


def test_the_settings_take_the_format_as_written() -> None:
    tree = load_settings(
        "demo",
        [
            "rollout.chat_template=on",  # YAML's `on` is true: still the switch meant
            "rollout.chat_template_kwargs.enable_thinking=false",
            "rollout.system_prompt=Think: then answer {x}.",
            "rollout.eos_tokens=[<|im_end|>, 7]",
        ],
    )
    fmt = tree.rollout.prompt_format
    assert fmt == PromptFormat(
        chat_template="on",
        chat_template_kwargs={"enable_thinking": False},
        system_prompt="Think: then answer {x}.",
    )
    assert tree.rollout.eos_tokens == ["<|im_end|>", 7]
    assert load_settings("demo", ["rollout.chat_template=off"]).rollout.chat_template == "off"
    with pytest.raises(ValueError, match=r"\['add_generation_prompt'\]: set by the rendering itself"):
        load_settings("demo", ["rollout.chat_template_kwargs.add_generation_prompt=false"])
    with pytest.raises(ValueError, match="eos_tokens"):
        load_settings("demo", ["rollout.eos_tokens=[]"])


def test_samples_show_the_prompt_the_model_saw() -> None:
    tokenizer = chat_tokenizer(QWEN3_LIKE)
    fmt = PromptFormat(system_prompt="Be brief.", chat_template_kwargs={"enable_thinking": False})
    group = random_group(np.random.default_rng(0), n=2, T=3, vocab_size=len(tokenizer))
    ids = render_prompt(tokenizer, group.prompt.text or "", fmt)
    group = group.model_copy(update={"prompt_token_ids": np.asarray(ids, dtype=np.int32)})
    (row,) = sample_rows(7, [group], 1, tokenizer)
    assert row["prompt"] == group.prompt.text  # the question as fed
    assert row["rendered_prompt"] == (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{group.prompt.text}<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_a_worker_says_at_start_what_it_renders_and_where_completions_end(tiny_model_dir: Path) -> None:  # noqa: F811
    said = chat_format_at_start(tiny_model_dir, PromptFormat(system_prompt="Be brief."), None)
    assert said == (
        "prompts as plain text (rollout.chat_template auto: the tokenizer has none), with a system prompt; "
        "completions end at <eos> (2) (the generation config and the tokenizer)"
    )
    named = chat_format_at_start(tiny_model_dir, PromptFormat(), ["Ċ"])
    assert named.endswith("completions end at Ċ (14) (rollout.eos_tokens)")
    with pytest.raises(PromptFormatError, match=re.escape(f"on, but the tokenizer in {tiny_model_dir}")):
        chat_format_at_start(tiny_model_dir, PromptFormat(chat_template="on"), None)
    with pytest.raises(ValueError, match=r"^rollout\.eos_tokens: '<end>' is not a token"):
        chat_format_at_start(tiny_model_dir, PromptFormat(), ["<end>"])
