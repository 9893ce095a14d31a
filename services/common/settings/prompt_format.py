"""How a prompt becomes the tokens a model sees: the `rollout` section's `chat_template`,
`chat_template_kwargs` and `system_prompt`, gathered into one `PromptFormat` that every renderer takes
(`services/common/modeling.py`'s `render_prompt`: the rollout workers, the evaluators and the launcher's
checks alike); re-exported by `settings.py`."""

from __future__ import annotations

from copy import copy
from typing import Annotated, Any, Literal, Protocol

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, JsonValue

from sparkrl.services.common.settings.section import Section

# `tokenizer.apply_chat_template`'s own arguments and the variables it hands every template: set by the
# rendering itself, so a kwarg of that name would collide with them (or silently change the rendering).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _yaml_switch(value: object) -> object:
    """YAML 1.1 reads a bare `on` / `off` as true / false (`--set rollout.chat_template=on`, a preset's
    `chat_template: off`): the switch they meant."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


def checked_template_kwargs(kwargs: dict[str, JsonValue]) -> dict[str, JsonValue]:
    """`kwargs`, unless a key is one the rendering sets itself (ValueError naming it)."""
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(
            f"chat_template_kwargs {reserved}: set by the rendering itself (apply_chat_template's own "
            "arguments and the template's messages), not template variables: drop them"
        )
    return kwargs


ChatTemplateMode = Annotated[Literal["auto", "on", "off"], BeforeValidator(_yaml_switch)]
TemplateKwargs = Annotated[dict[str, JsonValue], AfterValidator(checked_template_kwargs)]


class _HasPromptFormat(Protocol):  # a section holding the three fields (`rollout`, the evaluator's part)
    chat_template: ChatTemplateMode
    chat_template_kwargs: dict[str, JsonValue]
    system_prompt: str | None


class PromptFormat(Section):
    """Chat template (or plain text), its variables, and a system prompt: what turns a prompt's text or
    messages into token ids."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chat_template: ChatTemplateMode = Field(
        "auto",
        description="Prompts through the tokenizer's chat template: auto (when it has one), on (it must: a "
        "tokenizer without one is an error at start, naming the model directory) or off (plain text, for a "
        "base model: the messages' contents joined by newlines, with the tokenizer's own BOS/EOS). Each "
        "worker logs which is in force.",
    )
    chat_template_kwargs: TemplateKwargs = Field(
        default_factory=dict,
        description="Variables handed to the chat template (`apply_chat_template(..., **kwargs)`), e.g. "
        "{enable_thinking: false} for Qwen3, {reasoning_effort: low} for gpt-oss; unused without a template. "
        "A key the rendering sets itself (messages, add_generation_prompt, tokenize, ...) is an error.",
    )
    system_prompt: str | None = Field(
        None,
        description="Prepended to every prompt that has no system message of its own: a system message "
        "through the chat template, the text and a newline without one. None: none.",
    )

    @classmethod
    def of(cls, section: _HasPromptFormat) -> PromptFormat:
        """The format a section's fields of the same names hold (`rollout`, or the evaluator's part)."""
        return cls(
            chat_template=section.chat_template,
            chat_template_kwargs=section.chat_template_kwargs,
            system_prompt=section.system_prompt,
        )


def same_format_field(name: str) -> Any:
    """`PromptFormat`'s field `name` (default, description), for a section that holds it flat."""
    return copy(PromptFormat.model_fields[name])
