"""Shared prompts (`learner.share_prompts`): a group's answers packed behind one copy of their prompt.

A GRPO group is n answers to one prompt; collated a row each, the prompt runs n times. Here a row holds
units, one per group (or per part of a group too long for a row):

    [ prompt[:-1] | prompt[-1], answer_1 | prompt[-1], answer_2 | … | prompt[-1], answer_n ]
      the prefix    segment 1               segment 2                  segment n

Each segment starts with its own copy of the prompt's last token, at that token's position id, so that
the position predicting the answer's first token is the segment's own (the targets keep the layout of
batch.py: position j predicts token j+1). A block mask lets every position see, causally, its unit's
prefix and its own segment only, and the position ids are those of the prompt-then-answer row; so each
answer's logits are the ones its own padded row gives, and so the gradient (tests/test_prompt_sharing.py),
while the prompt's positions run once per unit instead of n times. Worth it where prompts are long
against the answers (n · P ≫ P + Σ T); the mask costs L² per row, so rows stay short (`pack_length`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from functools import partial

import torch

from sparkrl.services.learner.batch import Collate, MicroBatch, Sample, collate, pack, place


def collator(pad_id: int, pack_length: int | None, shared: bool) -> Collate:
    """How an update's micro-batches are collated: a row each (padded), packed into rows of
    `pack_length`, or with shared prompts (rows of `pack_length` at least)."""
    if shared:
        return partial(share_prompts, pad_id=pad_id, row_length=pack_length)
    if pack_length:
        return partial(pack, pad_id=pad_id, row_length=pack_length)
    return partial(collate, pad_id=pad_id)


def share_prompts(samples: list[Sample], pad_id: int, row_length: int | None) -> MicroBatch:
    """`samples` as units (one prefix, its answers' segments) first fit into rows of `row_length`
    positions (at least the longest unit's), a row's units all of one temperature."""
    units = _units(samples, row_length)
    pieces: list[Sample] = []
    unit_of: list[int] = []  # each piece's unit
    is_prefix: list[bool] = []
    lengths = []  # each unit's positions
    for u, (prefix, members) in enumerate(units):
        if len(prefix):  # a prompt of one token has no prefix: its segments carry it whole
            pieces.append(_prefix_piece(prefix, members[0]))
            unit_of.append(u)
            is_prefix.append(True)
        for sample in members:
            pieces.append(_segment_piece(sample))
            unit_of.append(u)
            is_prefix.append(False)
        lengths.append(len(prefix) + sum(_segment_length(s) for s in members))
    capacity = max(row_length or 0, max(lengths))
    unit_row, unit_offset, used = _first_fit(lengths, [m[0].temperature for _, m in units], capacity)
    row, offset, cursor = [], [], list(unit_offset)
    for piece, u in zip(pieces, unit_of, strict=True):
        row.append(unit_row[u])
        offset.append(cursor[u])
        cursor[u] += len(piece.input_ids)
    mb = place(pieces, torch.tensor(row), torch.tensor(offset), max(used), pad_id)
    B, L = mb.input_ids.shape
    position_ids = torch.zeros(B, L, dtype=torch.long)
    unit_ids = -1 - torch.arange(L).repeat(B, 1)  # padding: a unit of its own each, seeing only itself
    piece_ids = torch.zeros(B, L, dtype=torch.long)
    for index, piece in enumerate(pieces):
        n, r, c, u = len(piece.input_ids), row[index], offset[index], unit_of[index]
        start = 0 if is_prefix[index] else len(units[u][0])  # a segment goes on from its prompt's positions
        position_ids[r, c : c + n] = torch.arange(start, start + n)
        unit_ids[r, c : c + n] = u
        piece_ids[r, c : c + n] = 0 if is_prefix[index] else index + 1
    return MicroBatch(
        **(mb.fields() | {"position_ids": position_ids, "unit_ids": unit_ids, "piece_ids": piece_ids})
    )


def _units(samples: list[Sample], row_length: int | None) -> list[tuple[torch.Tensor, list[Sample]]]:
    """The samples by (prompt, temperature), each group's answers cut into as few units as fit a row."""
    by_prompt: dict[tuple[bytes, float], list[Sample]] = defaultdict(list)
    for s in samples:
        by_prompt[(s.input_ids[: s.prompt_len].numpy().tobytes(), s.temperature)].append(s)
    units = []
    for members in by_prompt.values():
        prefix = members[0].input_ids[: members[0].prompt_len - 1]
        capacity = max(row_length or 0, len(prefix) + max(_segment_length(s) for s in members))
        current, size = [], len(prefix)
        for s in sorted(members, key=_segment_length, reverse=True):
            if current and size + _segment_length(s) > capacity:
                units.append((prefix, current))
                current, size = [], len(prefix)
            current.append(s)
            size += _segment_length(s)
        units.append((prefix, current))
    return units


def _segment_length(sample: Sample) -> int:
    return len(sample.input_ids) - sample.prompt_len + 1


def _prefix_piece(prefix: torch.Tensor, like: Sample) -> Sample:
    """The prompt but its last token, as a piece that predicts nothing."""
    K = like.topk_ids.shape[-1]
    return Sample(
        input_ids=prefix,
        prompt_len=len(prefix),
        rollout_logp=torch.zeros(0),
        topk_ids=torch.zeros(0, K, dtype=torch.long),
        topk_logp=torch.zeros(0, K),
        advantage=0.0,
        temperature=like.temperature,
    )


def _segment_piece(sample: Sample) -> Sample:
    """The prompt's last token and the answer: the piece whose first position predicts the answer's first
    token (a prompt of one token: `prompt_len` 1 as well)."""
    return replace(sample, input_ids=sample.input_ids[sample.prompt_len - 1 :], prompt_len=1)


def _first_fit(
    lengths: list[int], temperatures: list[float], capacity: int
) -> tuple[list[int], list[int], list[int]]:
    """Units first fit by decreasing length into rows of `capacity`, one temperature a row → (each unit's
    row, its offset, the positions taken in each row)."""
    row, offset = [0] * len(lengths), [0] * len(lengths)
    used: list[int] = []
    temperature: list[float] = []
    for u in sorted(range(len(lengths)), key=lambda u: -lengths[u]):
        fits = (
            r
            for r in range(len(used))
            if temperature[r] == temperatures[u] and used[r] + lengths[u] <= capacity
        )
        r = next(fits, None)
        if r is None:
            r = len(used)
            used.append(0)
            temperature.append(temperatures[u])
        row[u], offset[u] = r, used[r]
        used[r] += lengths[u]
    return row, offset, used
