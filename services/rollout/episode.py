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
exact continuation: `environment_turn` returns None and the episode is split there (`Episode.split`):
a new training sample starts whose stream begins with the whole history re-rendered after the prompt —
context, never trained — and the model's next turn is sampled from exactly that context. Each sample
trains on its own model turns with the episode's reward; `Episode.splits` counts the splits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from sparkrl.proto import Completion

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
    """One episode's token stream after its prompt, as pieces: each model turn as the engine sampled it (a
    `Completion`: tokens, log-probs, top-k, versions) and each environment turn as token ids (context,
    never trained). `completion()` is the stream as one wire completion, the environment's positions
    named in `environment_spans`."""

    prompt_ids: list[int]
    pieces: list[Completion | list[int]] = field(default_factory=list)  # the sample in the making
    turns: int = 0  # model turns
    split_off: list[list[Completion | list[int]]] = field(default_factory=list)  # earlier samples' pieces

    def add_model_turn(self, turn: Completion) -> None:
        self.pieces.append(turn)
        self.turns += 1

    def add_environment_turn(self, token_ids: list[int]) -> None:
        self.pieces.append(list(token_ids))

    def split(self, history_ids: list[int]) -> None:
        """The sample so far is done; the next starts with `history_ids` (the whole history re-rendered,
        after the prompt) as its context (module docstring)."""
        self.split_off.append(self.pieces)
        self.pieces = [list(history_ids)]

    @property
    def splits(self) -> int:
        return len(self.split_off)

    @property
    def token_ids(self) -> list[int]:
        return [int(t) for piece in self.pieces for t in _ids(piece)]

    @property
    def is_model(self) -> list[bool]:
        """Who wrote each token of the stream: True the model (trained), False the environment."""
        return [isinstance(piece, Completion) for piece in self.pieces for _ in _ids(piece)]

    @property
    def context(self) -> list[int]:
        """What the model sees for its next turn: the prompt and the whole stream."""
        return self.prompt_ids + self.token_ids

    @property
    def samples(self) -> list[list[Completion | list[int]]]:
        """Each training sample's pieces: those split off, then the one in the making."""
        return [*self.split_off, self.pieces]

    @property
    def model_tokens(self) -> int:
        return sum(p.num_tokens for s in self.samples for p in s if isinstance(p, Completion))

    @property
    def environment_tokens(self) -> int:
        return sum(len(p) for s in self.samples for p in s if not isinstance(p, Completion))

    def completion(self, text: str) -> Completion:
        """The sample in the making as one wire completion (`completions`: every sample)."""
        return as_completion(self.pieces, text)

    @property
    def trained_samples(self) -> list[list[Completion | list[int]]]:
        """The samples with a model turn: what goes on the wire."""
        return [pieces for pieces in self.samples if any(isinstance(p, Completion) for p in pieces)]

    def completions(self, text_of: Callable[[list[int]], str]) -> list[Completion]:
        """Every sample with a model turn as one wire completion, its text `text_of` its token ids."""
        return [
            as_completion(pieces, text_of([int(t) for p in pieces for t in _ids(p)]))
            for pieces in self.trained_samples
        ]


def as_completion(pieces: list[Completion | list[int]], text: str) -> Completion:
    """A sample's pieces as one completion: the model's tokens with what the engine recorded, the
    environment's with log-prob 0, top-k the token itself at 0, the version of the model turn before (the
    first model turn's for a sample that starts with context: the wire's rule, proto/trajectory.py);
    finish reason the last model turn's."""
    model = [p for p in pieces if isinstance(p, Completion)]
    if not model:
        raise ValueError("an episode without a model turn has no completion")
    K = model[0].topk_ids.shape[1]
    arrays: dict[str, list[np.ndarray]] = {name: [] for name in _ARRAYS}
    spans, at, version = [], 0, int(model[0].policy_versions[0]) if model[0].num_tokens else 0
    for piece in pieces:
        if isinstance(piece, Completion):
            for name in _ARRAYS:
                arrays[name].append(getattr(piece, name))
            version = int(piece.policy_versions[-1]) if piece.num_tokens else version
            at += piece.num_tokens
            continue
        ids, m = np.asarray(piece, dtype=np.int32), len(piece)
        arrays["token_ids"].append(ids)
        arrays["logprobs"].append(np.zeros(m, dtype=np.float32))
        arrays["policy_versions"].append(np.full(m, version, dtype=np.int32))
        arrays["topk_ids"].append(np.repeat(ids[:, None], K, axis=1))
        arrays["topk_logprobs"].append(np.zeros((m, K), dtype=np.float32))
        if m:
            spans.append((at, at + m))
        at += m
    return Completion.model_validate(
        {name: np.concatenate(parts) for name, parts in arrays.items()}
        | {"text": text, "finish_reason": model[-1].finish_reason, "environment_spans": spans or None}
    )


_ARRAYS = ("token_ids", "logprobs", "policy_versions", "topk_ids", "topk_logprobs")


def _ids(piece: Completion | list[int]) -> list[int] | np.ndarray:
    return piece.token_ids if isinstance(piece, Completion) else piece
