"""An episode's token stream (issue 48, item 3; docs/architecture rule "the token stream is the truth").

A multi-turn episode is kept as tokens, never as text: the prompt as rendered once, then each model turn
as it was sampled (its stop token included) and each environment turn tokenized *on its own*, with the
chat template's turn delimiters — the text the template writes between the end of the model's turn and
the start of the next one. Re-rendering the history through the template and re-tokenizing it would give
tokens the policy never produced (a word split otherwise, a stripped think block), and the learner would
train on them.

`environment_turn` finds that in-between text by rendering the history twice with a sentinel as the
model's last message: without the environment's messages (no generation prompt), and with them (and the
generation prompt). The second must extend the first; the in-between text is what follows the sentinel
and the model's stop token. When the template does not extend (it rewrites earlier turns: Qwen3's drops
earlier think blocks) or the model stopped on another token than the template's end of turn, there is no
exact continuation: `environment_turn` returns None and the episode is split there (a new training
sample starts from the full re-rendering; `Episode.splits` counts them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

SENTINEL = "\u2063sparkrl-turn\u2063"  # invisible separators: text no template writes or trims

Message = dict[str, Any]


def environment_turn(
    tokenizer: PreTrainedTokenizerBase,
    history: list[Message],
    turn: list[Message],
    stop_token_id: int | None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int] | None:
    """The tokens that follow a model turn which ended with `stop_token_id` (None: it ran out of tokens,
    so the template's whole end of turn is the environment's to write): the rest of the end of turn,
    `turn` (the environment's messages: tool results, a user message) and the next assistant header.
    `history`: the messages so far, the model's last turn excluded (its content does not matter: it is
    the sentinel here). None: no exact continuation (module docstring)."""
    kwargs = template_kwargs or {}
    sentinel = {"role": "assistant", "content": SENTINEL}
    before = tokenizer.apply_chat_template(
        [*history, sentinel], tokenize=False, add_generation_prompt=False, **kwargs
    )
    after = tokenizer.apply_chat_template(
        [*history, sentinel, *turn], tokenize=False, add_generation_prompt=True, **kwargs
    )
    if SENTINEL not in before or not after.startswith(before):
        return None
    end_of_turn = before[before.index(SENTINEL) + len(SENTINEL) :]
    stop = "" if stop_token_id is None else tokenizer.decode([stop_token_id], skip_special_tokens=False)
    if not end_of_turn.startswith(stop):
        return None  # the template ends the turn otherwise than the model did
    between = end_of_turn[len(stop) :] + after[len(before) :]
    return list(tokenizer(between, add_special_tokens=False)["input_ids"])


@dataclass
class Episode:
    """One episode's token stream after its prompt: who wrote each token (True: the model, trained; False:
    the environment, context only), the model tokens' log-probs, and the splits made so far."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    is_model: list[bool] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    turns: int = 0
    splits: int = 0

    def add_model_turn(self, token_ids: list[int], logprobs: list[float]) -> None:
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} log-probs in a model turn")
        self.token_ids += token_ids
        self.is_model += [True] * len(token_ids)
        self.logprobs += logprobs
        self.turns += 1

    def add_environment_turn(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.is_model += [False] * len(token_ids)
        self.logprobs += [None] * len(token_ids)

    @property
    def context(self) -> list[int]:
        """What the model sees for its next turn: the prompt and the whole stream."""
        return self.prompt_ids + self.token_ids

    @property
    def model_tokens(self) -> int:
        return sum(self.is_model)
