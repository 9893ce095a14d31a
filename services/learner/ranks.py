"""A data-parallel learner (`learner.ranks`): rank 0 runs the loop, the other ranks follow its orders.

Rank 0 alone reads the bus, acknowledges, records the trained ids, reports, writes checkpoints' own files
and publishes weights. Whatever needs every rank, it first announces with a `RankOrder` broadcast on a
gloo group of the learner's ranks:

- `train`: every rank builds the step's micro-batches from the same groups, the same way, and takes its
  share (`Ranks.share`: every `size`-th one, padded with empty ones so that every rank runs as many
  forward/backward passes as the others); the token-mean's divisor is the step's global token count, so
  the averaged gradient is the single-rank one (`train_step` scales each rank's loss by the DP size,
  which DeepSpeed's gradient averaging divides out).
- `gather`: ZeRO-3's partitions are gathered for a full copy of the weights (a collective).
- `save`: DeepSpeed's checkpoint (each rank writes its optimizer partitions).
- `stop`: the run is over.

A rank that dies fails the next collective on the others: rank 0 ends the step with `RankLost`, writes
no checkpoint (the last complete one stays `latest`) and exits non-zero; the launcher stops the rest.
`--resume` restores every rank from that checkpoint and replays the journal: no group is trained twice.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from sparkrl.proto import RankOrder, TrajectoryGroup, decode_group, encode_group
from sparkrl.services.common.settings import LearnerSettings
from sparkrl.services.learner.batch import MicroBatch

log = logging.getLogger("sparkrl.learner.ranks")

# Followers wait for rank 0's next order as long as the run lasts (a paused learner may idle for hours);
# a dead rank 0 fails the wait at once (its connections close), so this only bounds a hung one.
ORDER_TIMEOUT = timedelta(days=7)
NOT_SUMMED = ("grad_norm", "tokens")  # the same on every rank already (global), not per-rank parts

T = TypeVar("T")


class RankLost(RuntimeError):
    """A collective between the learner's ranks failed: a rank died or cannot be reached."""


def world() -> tuple[int, int]:
    """(rank, size) of this learner process; (0, 1) without a launcher."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def lost(what: str, error: BaseException, last_checkpoint: int | None) -> RankLost:
    since = f"step {last_checkpoint}" if last_checkpoint else "the start (no checkpoint yet)"
    return RankLost(
        f"{what} failed on the learner's ranks — a rank died, cannot be reached, or raised "
        f"({type(error).__name__}: {str(error)[:300]}). The run stops here without a new checkpoint; "
        f"`--resume` continues from the last one ({since}) and replays the journal, so no group is "
        "trained twice."
    )


@dataclass
class Ranks:
    """The learner's ranks as rank 0 and its followers see them: orders, shares, summed statistics."""

    rank: int
    size: int
    group: dist.ProcessGroup

    @classmethod
    def join(cls) -> Ranks | None:
        """The orders' gloo group (a collective: every rank calls it at start-up); None for one rank."""
        rank, size = world()
        if size == 1:
            return None
        return cls(rank, size, dist.new_group(backend="gloo", timeout=ORDER_TIMEOUT))

    def send(self, order: RankOrder) -> None:
        """Rank 0: every follower gets `order` (they are waiting in `receive`)."""
        dist.broadcast_object_list([order], src=0, group=self.group)

    def receive(self) -> RankOrder:
        """A follower: rank 0's next order."""
        box: list[RankOrder | None] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        if not isinstance(box[0], RankOrder):
            raise RuntimeError(f"rank 0 sent {type(box[0]).__name__}, not a RankOrder")
        return box[0]

    def share(self, items: list[T], empty: Callable[[], T]) -> list[T]:
        """This rank's every `size`-th item (the micro-batches are sorted by length: the shares balance),
        padded with `empty()` up to the largest share, so that every rank runs as many passes."""
        count = -(-len(items) // self.size)
        mine = items[self.rank :: self.size]
        return mine + [empty() for _ in range(count - len(mine))]

    def sum_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """The step's statistics over every rank: each rank's are its share of the global numbers (token
        shares of the global count), so they add up; a rank with only padding has fewer keys."""
        every: list[dict[str, float] | None] = [None] * self.size
        dist.all_gather_object(every, stats, group=self.group)
        total: dict[str, float] = {}
        for part in every:
            for key, value in (part or {}).items():
                if key in NOT_SUMMED:
                    total[key] = value
                else:
                    total[key] = total.get(key, 0.0) + value
        return total


def train_order(groups: list[TrajectoryGroup], cfg: LearnerSettings, step: int) -> RankOrder:
    return RankOrder(
        kind="train", step=step, groups=[encode_group(g) for g in groups], learner=cfg.model_dump(mode="json")
    )


def order_groups(order: RankOrder) -> list[TrajectoryGroup]:
    return [decode_group(data) for data in order.groups]


def order_settings(order: RankOrder) -> LearnerSettings:
    return LearnerSettings.model_validate(order.learner)


def empty_like(mb: MicroBatch) -> MicroBatch:
    """A padding micro-batch: the first row's first two tokens and no target — a forward, and a backward
    of zero, that every collective of the pass still sees."""
    return MicroBatch(
        input_ids=mb.input_ids[:1, :2],
        attention_mask=mb.attention_mask[:1, :2],
        mask=torch.zeros_like(mb.mask[:1, :1]),
        rollout_logp=mb.rollout_logp[:1, :1],
        topk_ids=mb.topk_ids[:1, :1],
        topk_logp=mb.topk_logp[:1, :1],
        advantages=torch.zeros_like(mb.advantages[:1, :1]),
        temperature=mb.temperature[:1],
    )
