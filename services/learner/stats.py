"""What a step's updates did (`Updated`), and how an update's statistics combine over its micro-batches,
the step's updates and the learner's ranks."""

from __future__ import annotations

from dataclasses import dataclass

from sparkrl.services.common.losses.mismatch import COUNT_STATS, MEAN_STATS

Stats = dict[str, float]  # statistics by name (`loss`, `grad_norm`, …): the step row's loss/*

# How an update's statistics combine, said once for the micro-batches, the updates and the ranks: counts
# add up; every other statistic is a token-share-weighted part of a mean. GLOBAL ones are the whole
# update's on every rank already (its token count, the norm of the reduced gradient): ranks keep one copy.
# A loss's own counts end in `_tokens` (STAPO's `spurious_tokens`, DPPO's `masked_pos_tokens`): a new loss
# stays one file.
COUNTS = frozenset({"reg_tokens", "reg_tokens_pos", "proxy_inexact", "tokens", *COUNT_STATS})
GLOBAL = frozenset({"grad_norm", "tokens"})


def is_count(key: str) -> bool:
    """Whether the statistic `key` adds up (a count) rather than averaging by token share."""
    return key in COUNTS or key.endswith("_tokens")


def add_mismatch(sums: Stats, measured: dict[str, float], weight: float) -> None:
    """One micro-batch's mismatch statistics (losses/mismatch.py) into the update's `sums`: counts add up,
    token means weighted by the micro-batch's share of the tokens run (`weight`)."""
    for key in COUNT_STATS:
        sums[key] = sums.get(key, 0.0) + measured[key]
    for key in MEAN_STATS:
        sums[key] = sums.get(key, 0.0) + measured[key] * weight


def merge(stats: list[Stats]) -> Stats:
    """The updates' statistics as the step's: counts add up, rates and losses are averaged by token share."""
    total = sum(s.get("tokens", 0.0) for s in stats) or 1.0
    merged: Stats = {}
    for s in stats:
        weight = s.get("tokens", 0.0) / total
        for key, value in s.items():
            merged[key] = merged.get(key, 0.0) + (value if is_count(key) else value * weight)
    return merged


@dataclass(frozen=True)
class NotApplied:
    """An update whose loss or gradient norm was not finite: its gradients were dropped, and the step's
    later updates were not taken."""

    loss: float
    grad_norm: float


@dataclass(frozen=True)
class Updated:
    """What a step's updates did: their statistics (merged over the applied ones), the seconds by part
    (`collate`, `old_policy`, `entropy_of_skipped`, `forward_backward`, `optimizer`), how many were
    applied, and the one that was not, if any (the guard decides what its groups become)."""

    stats: Stats
    seconds: Stats
    applied: int
    not_applied: NotApplied | None = None

    def row(self) -> Stats:
        """The statistics as the step row carries them (loss/*): with `updates` and, when one was not
        applied, `updates_skipped`, `skipped_loss` and `skipped_grad_norm`."""
        row = self.stats | {"updates": float(self.applied)}
        if self.stats.get("is_seqs"):  # sequences, not tokens: a share of the counts, not a token mean
            for kind in ("capped", "masked"):
                row[f"is_{kind}_seq_share"] = self.stats[f"is_{kind}_seqs"] / self.stats["is_seqs"]
        if self.not_applied is not None:
            skipped = self.not_applied
            row |= {"updates_skipped": 1.0, "skipped_loss": skipped.loss}
            row["skipped_grad_norm"] = skipped.grad_norm
        return row
