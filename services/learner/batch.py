"""From trajectory groups to micro-batches of per-token tensors.

Layout: each row is prompt + completion, right-padded to the micro-batch's longest row, L tokens. The
model's logits at position j predict token j+1, so every per-token tensor is [B, L-1] and indexed by the
*predicting* position: `mask[b, j]` is True where input_ids[b, j+1] is a generated token.

Packed (`learner.pack_length`, `pack`): a row holds several samples one after the other, each with
position ids from 0, so that attention does not cross from one to the next; the same per-token layout.
Shared prompts (`learner.share_prompts`, prompt_sharing.py): a group's answers behind one copy of their
prompt, a block mask (`unit_ids`, `piece_ids`) keeping each answer to its prompt and itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from sparkrl.proto import Completion, TrajectoryGroup
from sparkrl.services.learner.advantages import step_advantages


@dataclass(frozen=True)
class Sample:
    """One completion ready to train on."""

    input_ids: Tensor  # [P+T] long: prompt then completion
    prompt_len: int  # P
    rollout_logp: Tensor  # [T] float32, log-prob under the sampling distribution
    topk_ids: Tensor  # [T, K] long
    topk_logp: Tensor  # [T, K] float32
    advantage: float  # GRPO advantage, shared by every token of the completion
    temperature: float  # the sampling temperature; the learner's log-probs are taken at it
    truncated: bool = False  # it hit max_new_tokens (finish_reason `length`): mask_truncated_completions
    # [T] bool, True where the model sampled the token; None: all of them. A multi-turn episode's
    # environment tokens (docs/agents.md) are context: no loss, no count, no Lp-Reg percentile reaches them.
    model_tokens: Tensor | None = None

    @property
    def length(self) -> int:
        """Positions after the prompt: the model's tokens and the environment's."""
        return len(self.rollout_logp)

    @property
    def num_tokens(self) -> int:
        """The model's tokens: the loss's."""
        if self.model_tokens is None:
            return self.length
        return int(self.model_tokens.sum())

    @property
    def trained(self) -> bool:
        """Whether a loss term reaches it when terms vanish at A = 0 (`update_micro_batches`)."""
        return self.advantage != 0 and self.num_tokens > 0


@dataclass(frozen=True)
class MicroBatch:
    """Padded tensors of a few samples; per-token tensors are [B, L-1] (see module docstring)."""

    input_ids: Tensor  # [B, L] long
    attention_mask: Tensor  # [B, L] long
    mask: Tensor  # [B, L-1] bool: generated-token targets
    rollout_logp: Tensor  # [B, L-1] float32
    topk_ids: Tensor  # [B, L-1, K] long
    topk_logp: Tensor  # [B, L-1, K] float32
    advantages: Tensor  # [B, L-1] float32
    temperature: Tensor  # [B, 1, 1] float32, divides the logits
    position_ids: Tensor | None = None  # [B, L] long, from 0 in each sample: packed rows; None: padded
    # Shared prompts (prompt_sharing.py), else None: each position's unit (a prompt and its answers; a
    # padding position is a unit of its own) and piece (0: the unit's prefix; else its answer's segment).
    unit_ids: Tensor | None = None  # [B, L] long
    piece_ids: Tensor | None = None  # [B, L] long

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    def fields(self) -> dict[str, Tensor | None]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(**{name: None if t is None else t.to(device) for name, t in self.fields().items()})

    def model_inputs(self) -> dict[str, Tensor]:
        """The model's keyword arguments: padded rows mask their padding; packed rows give position ids
        instead, from which transformers builds a causal mask that does not cross samples; shared prompts
        give both and a 4D additive mask (used as is by eager and sdpa attention)."""
        if self.position_ids is None:
            return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        if self.unit_ids is None or self.piece_ids is None:
            return {"input_ids": self.input_ids, "position_ids": self.position_ids}
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": self.block_mask(),
        }

    def block_mask(self) -> Tensor:
        """[B, 1, L, L] float: 0 where a query position (dim 2) may see a key position (dim 3) — causally,
        within its unit, the unit's prefix or its own piece — the dtype's lowest value elsewhere."""
        assert self.unit_ids is not None and self.piece_ids is not None
        unit, piece = self.unit_ids, self.piece_ids
        L = unit.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=unit.device).tril()
        same_unit = unit[:, :, None] == unit[:, None, :]
        sees = (piece[:, None, :] == 0) | (piece[:, :, None] == piece[:, None, :])
        allowed = (causal & same_unit & sees)[:, None]  # [B, 1, L, L]
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=unit.device)
        return mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)


def samples_from_groups(
    groups: list[TrajectoryGroup], eps: float = 1e-6, std_normalize: bool = True, level: str = "group"
) -> list[Sample]:
    """Flatten groups into samples with their advantages (GRPO's by default: normalized within each
    group; see `step_advantages` for the other modes)."""
    samples = []
    rewards = [torch.tensor(group.rewards, dtype=torch.float32) for group in groups]
    for group, advantages in zip(groups, step_advantages(rewards, std_normalize, level, eps), strict=True):
        prompt = torch.from_numpy(group.prompt_token_ids.astype("int64"))
        for completion, advantage in zip(group.completions, advantages.tolist(), strict=True):
            token_ids = torch.from_numpy(completion.token_ids.astype("int64"))
            samples.append(
                Sample(
                    input_ids=torch.cat([prompt, token_ids]),
                    prompt_len=len(prompt),
                    rollout_logp=torch.from_numpy(completion.logprobs.copy()),
                    topk_ids=torch.from_numpy(completion.topk_ids.astype("int64")),
                    topk_logp=torch.from_numpy(completion.topk_logprobs.copy()),
                    advantage=advantage,
                    temperature=group.sampling.temperature,
                    truncated=completion.finish_reason == "length",
                    model_tokens=_model_tokens(completion),
                )
            )
    return samples


def _model_tokens(completion: Completion) -> Tensor | None:
    if completion.environment_spans is None:
        return None
    return torch.from_numpy(completion.model_token_mask())


def collate(samples: list[Sample], pad_id: int) -> MicroBatch:
    """Right-pad `samples` into one micro-batch, a row each."""
    rows = torch.arange(len(samples))
    return place(samples, rows, torch.zeros_like(rows), max(len(s.input_ids) for s in samples), pad_id)


def pack(samples: list[Sample], pad_id: int, row_length: int) -> MicroBatch:
    """`samples` packed into rows of `row_length` positions (at least the longest sample's), or padded, a
    row each, where packing would not run fewer positions (B · L). Packed: first fit by decreasing length,
    a row's samples all of one temperature, each sample's position ids from 0, and so the padding after a
    row's last sample (a segment of its own)."""
    longest = max(len(s.input_ids) for s in samples)
    row, offset, used = _first_fit(samples, max(row_length, longest))
    if len(used) * max(used) >= len(samples) * longest:
        return collate(samples, pad_id)
    return place(samples, row, offset, max(used), pad_id)


def _first_fit(samples: list[Sample], capacity: int) -> tuple[Tensor, Tensor, list[int]]:
    """First fit by decreasing length into rows of `capacity`, one temperature a row → (each sample's row,
    its offset in the row, the positions taken in each row)."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].input_ids))
    shortest = len(samples[order[-1]].input_ids)
    used: list[int] = []
    temperature: list[float] = []
    open_rows: list[int] = []  # rows with room for the shortest sample still
    row, offset = torch.zeros(len(samples), dtype=torch.long), torch.zeros(len(samples), dtype=torch.long)
    for i in order:
        n, t = len(samples[i].input_ids), samples[i].temperature
        r = next((r for r in open_rows if temperature[r] == t and used[r] + n <= capacity), None)
        if r is None:
            r = len(used)
            used.append(0)
            temperature.append(t)
            open_rows.append(r)
        row[i], offset[i] = r, used[r]
        used[r] += n
        if capacity - used[r] < shortest:
            open_rows.remove(r)
    return row, offset, used


def place(samples: list[Sample], row: Tensor, offset: Tensor, L: int, pad_id: int) -> MicroBatch:
    """The micro-batch holding sample i at row[i] from position offset[i], rows of L positions: position
    ids restart at 0 per sample where any row holds two. The per-target tensors are scattered in one
    indexed copy each (not sample by sample: a step collates hundreds)."""
    B = int(row.max()) + 1
    lengths = torch.tensor([len(s.input_ids) for s in samples])
    # Every position of every sample, as (row, column): its input id and its position id.
    rows_all = torch.repeat_interleave(row, lengths)
    within = _ranks_within(lengths)
    cols_all = torch.repeat_interleave(offset, lengths) + within
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    input_ids[rows_all, cols_all] = torch.cat([s.input_ids for s in samples])
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    attention_mask[rows_all, cols_all] = 1
    position_ids = None
    if B < len(samples):  # packed: every sample from 0, and the padding after a row's last sample too
        position_ids = torch.arange(L).repeat(B, 1) - attention_mask.sum(dim=1, keepdim=True)
        position_ids[rows_all, cols_all] = within
    # Groups may carry different top-k widths (workers configured apart): pad to the widest, the padding
    # far below any real log-prob, so it is never in a kept set.
    K = max(s.topk_ids.shape[-1] for s in samples)
    # Generated token i of a sample sits at position P+i and is predicted from position P+i-1; the mask
    # holds the model's tokens only (an environment's are context).
    counts = torch.tensor([s.length for s in samples])
    rows = torch.repeat_interleave(row, counts)
    starts = offset + torch.tensor([s.prompt_len - 1 for s in samples])
    cols = torch.repeat_interleave(starts, counts) + _ranks_within(counts)
    mask = torch.zeros(B, L - 1, dtype=torch.bool)
    mask[rows, cols] = torch.cat([_model_mask(s) for s in samples])
    rollout_logp = torch.zeros(B, L - 1)
    rollout_logp[rows, cols] = torch.cat([s.rollout_logp for s in samples])
    topk_ids = torch.zeros(B, L - 1, K, dtype=torch.long)
    topk_logp = torch.full((B, L - 1, K), -1e4)  # far below any real log-prob: never in a kept set
    widths = {s.topk_ids.shape[-1] for s in samples}
    if widths == {K}:
        topk_ids[rows, cols] = torch.cat([s.topk_ids for s in samples])
        topk_logp[rows, cols] = torch.cat([s.topk_logp for s in samples])
    else:  # mixed widths: each width's samples in turn
        for k in widths:
            chosen = [i for i, s in enumerate(samples) if s.topk_ids.shape[-1] == k]
            at = torch.isin(torch.repeat_interleave(torch.arange(len(samples)), counts), torch.tensor(chosen))
            topk_ids[rows[at], cols[at], :k] = torch.cat([samples[i].topk_ids for i in chosen])
            topk_logp[rows[at], cols[at], :k] = torch.cat([samples[i].topk_logp for i in chosen])
    advantages = torch.zeros(B, L - 1)
    advantages[rows, cols] = torch.repeat_interleave(torch.tensor([s.advantage for s in samples]), counts)
    temperature = torch.zeros(B)
    temperature[row] = torch.tensor([s.temperature for s in samples])  # one per row (`pack`)
    return MicroBatch(
        input_ids,
        attention_mask,
        mask,
        rollout_logp,
        topk_ids,
        topk_logp,
        advantages,
        temperature.view(B, 1, 1),
        position_ids,
    )


def _model_mask(sample: Sample) -> Tensor:
    if sample.model_tokens is None:
        return torch.ones(sample.length, dtype=torch.bool)
    return sample.model_tokens


def _ranks_within(counts: torch.Tensor) -> torch.Tensor:
    """0, 1, …, counts[0]-1, 0, 1, …, counts[1]-1, …"""
    offsets = torch.cumsum(counts, 0) - counts
    return torch.arange(int(counts.sum())) - torch.repeat_interleave(offsets, counts)


def partition(samples: list[Sample], token_budget: int) -> list[list[Sample]]:
    """The samples of each micro-batch: sorted by length, a micro-batch grows while B · L (its padded
    rows) stays within the budget. A single sample longer than the budget still gets one of its own.
    Packed or not, these are the micro-batches (Lp-Reg counts its k in each)."""
    ordered = sorted(samples, key=lambda s: len(s.input_ids))
    parts: list[list[Sample]] = []
    current: list[Sample] = []
    for sample in ordered:
        longest = len(sample.input_ids)  # sorted ascending: the newcomer is the longest row
        if current and (len(current) + 1) * longest > token_budget:
            parts.append(current)
            current = []
        current.append(sample)
    if current:
        parts.append(current)
    return parts


def micro_batches(samples: list[Sample], token_budget: int, pad_id: int) -> list[MicroBatch]:
    """`partition`'s micro-batches, padded."""
    return [collate(part, pad_id) for part in partition(samples, token_budget)]


def empty_like(mb: MicroBatch) -> MicroBatch:
    """A padding micro-batch: the first row's first two tokens and no target — a forward, and a backward
    of zero, that every collective of the pass still sees."""
    return MicroBatch(
        position_ids=None if mb.position_ids is None else mb.position_ids[:1, :2],
        input_ids=mb.input_ids[:1, :2],
        attention_mask=mb.attention_mask[:1, :2],
        mask=torch.zeros_like(mb.mask[:1, :1]),
        rollout_logp=mb.rollout_logp[:1, :1],
        topk_ids=mb.topk_ids[:1, :1],
        topk_logp=mb.topk_logp[:1, :1],
        advantages=torch.zeros_like(mb.advantages[:1, :1]),
        temperature=mb.temperature[:1],
    )


def padded_positions(mb: MicroBatch) -> tuple[int, int]:
    """(positions the forward runs on, those of them padding): B·L and B·L − real tokens."""
    positions = mb.attention_mask.numel()
    return positions, positions - int(mb.attention_mask.sum())


class Totals(NamedTuple):
    """An update's counts, over every rank: its `tokens` and `sequences` (the loss's divisors) and the
    tokens it runs (`trained`; fewer when A = 0 completions are left out). None: the tokens."""

    tokens: int
    sequences: int
    trained: int | None = None


Collate = Callable[[list[Sample]], MicroBatch]  # `collate`, `pack` or `share_prompts`, its settings bound


def update_micro_batches(
    parts: list[list[Sample]], collate_fn: Collate, skip_zero_advantage: bool
) -> list[MicroBatch]:
    """An update's micro-batches from `partition`'s parts, collated by `collate_fn` (prompt_sharing.py's
    `collator`: padded, packed, or with shared prompts). `skip_zero_advantage`: without the samples no
    loss term reaches (A = 0, or no token, under a loss registered `zero_advantage_free`), each part's
    other samples kept together (Lp-Reg counts its k per micro-batch), and one empty pass when nothing is
    left, so the optimizer still steps (Adam moves on a zero gradient too) as it would have. The gradient
    is the same provided the caller still divides by every token of the update, the skipped included
    (update.py)."""
    made = []
    for part in parts:
        run = [s for s in part if s.trained] if skip_zero_advantage else part
        if run:
            made.append(collate_fn(run))
    return made or [empty_like(collate_fn(parts[0][:1]))]


def skipped_micro_batches(parts: list[list[Sample]], collate_fn: Collate) -> list[MicroBatch]:
    """The completions `update_micro_batches` leaves out when skipping (A = 0, with tokens), collated as it
    collates the others: what the entropy of the skipped is measured on (update.py)."""
    made = []
    for part in parts:
        left = [s for s in part if not s.trained and s.num_tokens > 0]
        if left:
            made.append(collate_fn(left))
    return made


def work_done(every: list[list[MicroBatch]], totals: list[Totals]) -> dict[str, float]:
    """The step's `skipped_tokens` (A = 0 tokens not run), `padding_share` (of the positions run) and
    `micro_batches` (the forward/backward passes that ran tokens)."""
    tokens = sum(t.tokens for t in totals)
    run = sum(mb.num_tokens for mbs in every for mb in mbs)
    counted = [padded_positions(mb) for mbs in every for mb in mbs]  # none: every group left out
    positions, padding = sum(p for p, _ in counted), sum(pad for _, pad in counted)
    passes = sum(1 for mbs in every for mb in mbs if mb.num_tokens)
    return {
        "skipped_tokens": float(tokens - run),
        "padding_share": padding / max(positions, 1),
        "micro_batches": float(passes),
    }
