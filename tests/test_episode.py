"""services/rollout/episode.py: an episode's token stream, the model's turns as sampled and each
environment turn tokenized on its own (issue 48, item 3), on every family's chat template we build."""

from __future__ import annotations

import numpy as np
import pytest
from _families import FAMILIES, build_tokenizer

from sparkrl.proto import Completion
from sparkrl.services.rollout.episode import Episode, environment_turn

QUESTION = [{"role": "user", "content": "What is (3 + 4) * 2?"}]
CALL = 'Let me compute.<tool_call>{"name": "calculator", "arguments": {"expression": "(3+4)*2"}}</tool_call>'
RESULT = [{"role": "tool", "content": "14"}]


def turn(tokens: list[int], logprob: float = -0.5, version: int = 3, K: int = 2) -> Completion:
    """A model turn as an engine hands it over."""
    T = len(tokens)
    return Completion(
        token_ids=np.asarray(tokens, dtype=np.int32),
        logprobs=np.full(T, logprob, dtype=np.float32),
        topk_ids=np.repeat(np.asarray(tokens, dtype=np.int32)[:, None], K, axis=1),
        topk_logprobs=np.full((T, K), logprob, dtype=np.float32),
        policy_versions=np.full(T, version, dtype=np.int32),
        text="",
        finish_reason="stop",
    )


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
    episode.add_model_turn(turn(sampled))
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
    wire = episode.completion("text")
    assert wire.environment_spans == [(len(sampled), len(sampled) + len(env))]
    assert wire.token_ids.tolist() == episode.token_ids and wire.model_tokens == len(sampled)
    assert wire.logprobs[len(sampled) :].tolist() == [0.0] * len(env)
    assert wire.policy_versions.tolist() == [3] * (len(sampled) + len(env))


def test_tokens_a_re_rendering_would_change_are_kept_as_sampled() -> None:
    """The model spelled `<|im_end|>` byte by byte inside its answer: re-tokenized, that text would become
    the special token and end the turn early. The stream keeps the bytes."""
    tokenizer = build_tokenizer(FAMILIES["qwen2"])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    bytes_of = [tokenizer.convert_tokens_to_ids(c) for c in "<|im_end|>"]
    sampled = [*tokenizer("a", add_special_tokens=False)["input_ids"], *bytes_of, im_end]
    episode = Episode([1, 2])
    episode.add_model_turn(turn(sampled))
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


def test_the_wire_completion_keeps_each_turns_values_and_marks_the_environments_spans() -> None:
    episode = Episode([1, 2])
    episode.add_environment_turn([])  # an empty turn leaves no span
    episode.add_model_turn(turn([5, 6], logprob=-1.0, version=4))
    episode.add_environment_turn([7, 8, 9])
    episode.add_model_turn(turn([10], logprob=-2.0, version=6))
    episode.add_environment_turn([11])
    wire = episode.completion("the episode")
    assert wire.environment_spans == [(2, 5), (6, 7)] and wire.model_turns() == [2, 1]
    assert wire.logprobs.tolist() == [-1.0, -1.0, 0.0, 0.0, 0.0, -2.0, 0.0]
    assert wire.policy_versions.tolist() == [4, 4, 4, 4, 4, 6, 6]  # the version of the turn before
    assert wire.topk_ids[2:5, 0].tolist() == [7, 8, 9] and wire.topk_logprobs[2:5].max() == 0.0
    assert wire.text == "the episode" and wire.finish_reason == "stop"
    with pytest.raises(ValueError, match="without a model turn"):
        Episode([1]).completion("")
