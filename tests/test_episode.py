"""services/rollout/episode.py: an episode's token stream, the model's turns as sampled and each
environment turn tokenized on its own (issue 48, item 3), on every family's chat template we build."""

from __future__ import annotations

import pytest
from _families import FAMILIES, build_tokenizer

from sparkrl.services.rollout.episode import Episode, environment_turn

QUESTION = [{"role": "user", "content": "What is (3 + 4) * 2?"}]
CALL = 'Let me compute.<tool_call>{"name": "calculator", "arguments": {"expression": "(3+4)*2"}}</tool_call>'
RESULT = [{"role": "tool", "content": "14"}]


def _stop_token(tokenizer, family) -> int | None:  # type: ignore[no-untyped-def]
    """The family's stop token that ends an assistant turn in its template, if one does."""
    text = tokenizer.apply_chat_template([*QUESTION, {"role": "assistant", "content": "X"}], tokenize=False)
    after = text[text.rindex("X") + 1 :]
    return next((tokenizer.convert_tokens_to_ids(s) for s in family.stop if after.startswith(s)), None)


@pytest.mark.parametrize("key", sorted(FAMILIES))
def test_the_stream_is_the_templates_rendering_without_ever_re_rendering(key: str) -> None:
    """Prompt + the model's tokens + the environment's turn tokenized alone = the whole conversation
    rendered at once, for every template that extends its history; the model's tokens stay as sampled."""
    family = FAMILIES[key]
    tokenizer = build_tokenizer(family)
    stop = _stop_token(tokenizer, family)
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    episode = Episode(list(tokenizer(prompt, add_special_tokens=False)["input_ids"]))
    assert stop is not None, f"{key}'s template ends no assistant turn with one of its stop tokens"
    sampled = [*tokenizer(CALL, add_special_tokens=False)["input_ids"], stop]
    episode.add_model_turn(sampled, [-0.5] * len(sampled))
    env = environment_turn(tokenizer, QUESTION, RESULT, stop)
    if key == "phi3":
        assert env is None  # its template writes EOS after the last turn unless a generation prompt follows
        return
    assert env is not None
    episode.add_environment_turn(env)
    whole = tokenizer.apply_chat_template(
        [*QUESTION, {"role": "assistant", "content": CALL}, *RESULT],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert episode.context == list(tokenizer(whole, add_special_tokens=False)["input_ids"])
    assert episode.token_ids[: len(sampled)] == sampled and episode.model_tokens == len(sampled)
    assert episode.is_model == [True] * len(sampled) + [False] * len(env)
    assert episode.logprobs[len(sampled) :] == [None] * len(env)


def test_tokens_a_re_rendering_would_change_are_kept_as_sampled() -> None:
    """The model spelled `<|im_end|>` byte by byte inside its answer: re-tokenized, that text would become
    the special token and end the turn early. The stream keeps the bytes."""
    tokenizer = build_tokenizer(FAMILIES["qwen2"])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    bytes_of = [tokenizer.convert_tokens_to_ids(c) for c in "<|im_end|>"]
    sampled = [*tokenizer("a", add_special_tokens=False)["input_ids"], *bytes_of, im_end]
    episode = Episode([1, 2])
    episode.add_model_turn(sampled, [0.0] * len(sampled))
    text = tokenizer.decode(sampled[:-1])
    assert (
        tokenizer(text, add_special_tokens=False)["input_ids"] != sampled[:-1]
    )  # what re-rendering would do
    env = environment_turn(tokenizer, QUESTION, RESULT, im_end)
    assert env is not None
    episode.add_environment_turn(env)
    assert episode.token_ids[: len(sampled)] == sampled


# Qwen3's real template drops the think block of every assistant turn but the last: a re-rendered history
# would lose what the model thought. The stream never re-renders, so only the delimiters matter.
STRIPS_THINKING = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A template that closes the conversation differently when the assistant spoke last (as Phi-3's writes EOS).
MARKS_THE_LAST_TURN = STRIPS_THINKING.replace(
    "{% if add_generation_prompt %}",
    "{% if not add_generation_prompt %}{{ 'END' }}{% endif %}{% if add_generation_prompt %}",
)


def test_a_template_that_rewrites_history_still_extends_and_one_that_cannot_is_a_split() -> None:
    tokenizer = build_tokenizer(FAMILIES["qwen3"])
    im_end, eos = (
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    plain = environment_turn(tokenizer, QUESTION, RESULT, im_end)
    assert plain is not None
    assert environment_turn(tokenizer, QUESTION, RESULT, eos) is None  # the model stopped on another token
    thought = [
        *QUESTION,
        {"role": "assistant", "content": "<think>hm</think>7"},
        {"role": "user", "content": "x2?"},
    ]
    tokenizer.chat_template = STRIPS_THINKING
    assert environment_turn(tokenizer, QUESTION, RESULT, im_end) == plain  # the same delimiters
    assert environment_turn(tokenizer, thought, RESULT, im_end) == plain
    tokenizer.chat_template = MARKS_THE_LAST_TURN
    assert environment_turn(tokenizer, QUESTION, RESULT, im_end) is None


def test_a_model_turn_needs_a_log_prob_per_token() -> None:
    with pytest.raises(ValueError, match="3 tokens but 2 log-probs"):
        Episode([1]).add_model_turn([5, 6, 7], [0.0, 0.0])
