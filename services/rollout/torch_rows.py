"""The torch engine's batch state: the sampled tokens (`Sampled`), a sample to make (`Row`), the rows being
decoded (`Live`), and one sampling step (`sample_next`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparkrl.proto import Completion


@dataclass
class Sampled:
    """One batched decoding run: per-position tensors, row r valid up to `length[r]` (a continued row's
    prefix copied in first)."""

    tokens: torch.Tensor  # [B, S] int64
    logprobs: torch.Tensor  # [B, S] float32
    topk_ids: torch.Tensor  # [B, S, K] int64
    topk_logprobs: torch.Tensor  # [B, S, K] float32
    versions: torch.Tensor  # [B, S] int32: the policy version each token was sampled with
    length: torch.Tensor  # [B] int64: tokens held per row
    finish: list[str]  # stop (EOS, a stop string), length (max_new_tokens); abort until a row ends
    by_stop_string: list[bool]

    @classmethod
    def start(cls, prefixes: list[Completion | None], S: int, K: int, device: torch.device) -> Sampled:
        """Room for S tokens per row, each continued row's prefix in place."""
        B = len(prefixes)
        result = cls(
            tokens=torch.zeros((B, S), dtype=torch.long, device=device),
            logprobs=torch.zeros((B, S), dtype=torch.float32, device=device),
            topk_ids=torch.zeros((B, S, K), dtype=torch.long, device=device),
            topk_logprobs=torch.zeros((B, S, K), dtype=torch.float32, device=device),
            versions=torch.zeros((B, S), dtype=torch.int32, device=device),
            length=torch.zeros(B, dtype=torch.long, device=device),
            finish=["abort"] * B,
            by_stop_string=[False] * B,
        )
        for row, prefix in enumerate(prefixes):
            T = 0 if prefix is None else prefix.num_tokens
            if T == 0:
                continue
            assert prefix is not None
            for name, array in (("tokens", prefix.token_ids), ("logprobs", prefix.logprobs),
                                ("topk_ids", prefix.topk_ids), ("topk_logprobs", prefix.topk_logprobs),
                                ("versions", prefix.policy_versions)):  # fmt: skip
                target = getattr(result, name)
                target[row, :T] = torch.tensor(array, device=device).to(target.dtype)
            result.length[row] = T
        return result


@dataclass
class Row:
    """One sample to make: its prompt and, when it is continued, the tokens it holds already."""

    prompt: list[int]
    prefix: Completion | None


@dataclass
class Live:
    """The rows being decoded: their model state and which of them still sample."""

    rows: torch.Tensor  # [b] int64: the result row of each batch row
    active: torch.Tensor  # [b] bool
    logits: torch.Tensor  # [b, V]: the next token's
    cache: Any
    attention_mask: torch.Tensor  # [b, L]
    next_position: torch.Tensor  # [b, 1]
    token: torch.Tensor | None = None  # [b]: the tokens just sampled, to run next


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    k: int,
    generator: torch.Generator,
    banned: torch.Tensor | None = None,
    banned_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoding step from `logits` [B, V]: (token [B], its logp [B], top-k logps [B, K], ids [B, K]).

    All log-probs come from `log_softmax(logits / T)` in float32; top-p and `banned` (token ids never to
    sample, e.g. EOS before `min_new_tokens`; in the rows `banned_rows` [B] marks, else in all) mask only
    the sampling.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, V]
    topk_logp, topk_ids = torch.topk(logp, k, dim=-1)  # sorted descending
    probs = logp.exp()
    if banned is not None and banned_rows is None:
        probs[:, banned] = 0.0
    elif banned is not None and banned_rows is not None:
        probs[:, banned] = probs[:, banned] * (~banned_rows).unsqueeze(1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p; the first always stays.
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    token = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # [B]
    token_logp = logp.gather(1, token[:, None]).squeeze(1)
    return token, token_logp, topk_logp, topk_ids


def distinct_adjacent(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """(the prompts with adjacent repeats collapsed, the index in it of every row): a group's rows share
    one prefill."""
    distinct: list[list[int]] = []
    owner: list[int] = []
    for prompt in prompts:
        if not distinct or distinct[-1] != prompt:
            distinct.append(prompt)
        owner.append(len(distinct) - 1)
    return distinct, owner
