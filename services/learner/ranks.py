"""A data-parallel learner (`learner.ranks`): rank 0 runs the loop with a `ManyRanks` trainer; the other
ranks `follow` its orders.

Rank 0 alone reads the bus, acknowledges, records the trained ids, reports, writes checkpoints' own files
and publishes weights. Whatever needs every rank, its trainer first announces with a `RankOrder` broadcast
on a gloo group of the learner's ranks:

- `train`: every rank builds the step's micro-batches from the same groups, the same way, and takes its
  share (`Ranks.share`: every `size`-th one, padded with empty ones so that every rank runs as many
  forward/backward passes as the others); the token-mean's divisor is the update's global token count, so
  the averaged gradient is the single-rank one (`apply_update` scales each rank's loss by the DP size,
  which DeepSpeed's gradient averaging divides out).
- `gather`: ZeRO-3's partitions are gathered for a full copy of the weights (a collective).
- `save`: DeepSpeed's checkpoint (each rank writes its optimizer partitions).
- `stop`: the run is over.

A rank that dies fails the next collective on the others: rank 0's trainer raises `RankLost` (and keeps
why in `lost`), the run writes no checkpoint (the last complete one stays `latest`) and exits non-zero;
the launcher stops the rest. `--resume` restores every rank from that checkpoint and replays the
journal: no group is trained twice.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from sparkrl.proto import RankOrder, TrajectoryGroup, decode_group, encode_group
from sparkrl.services.common.settings import LearnerSettings
from sparkrl.services.common.settings.roles import LearnerConfig
from sparkrl.services.learner.batch import MicroBatch, empty_like
from sparkrl.services.learner.checkpoint import cpu_weights, join_gather, save_checkpoint, save_partitions
from sparkrl.services.learner.ledger import Batch
from sparkrl.services.learner.startup import watchdog
from sparkrl.services.learner.state import TrainState
from sparkrl.services.learner.stats import GLOBAL, Stats, Updated
from sparkrl.services.learner.trainer import Loaded, OneRank, Trainer, load
from sparkrl.services.learner.update import run_updates

log = logging.getLogger("sparkrl.learner")

# Followers wait for rank 0's next order as long as the run lasts (a paused learner may idle for hours);
# a dead rank 0 fails the wait at once (its connections close), so this only bounds a hung one.
ORDER_TIMEOUT = timedelta(days=7)

T = TypeVar("T")


class RankLost(RuntimeError):
    """A collective between the learner's ranks failed: a rank died or cannot be reached."""


def world() -> tuple[int, int]:
    """(rank, size) of this learner process; (0, 1) without a launcher."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


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

    def share(self, micro: list[MicroBatch]) -> list[MicroBatch]:
        """This rank's every `size`-th micro-batch (they are sorted by length: the shares balance), padded
        with empty ones up to the largest share, so that every rank runs as many passes."""
        count = -(-len(micro) // self.size)
        mine = micro[self.rank :: self.size]
        return mine + [empty_like(micro[0]) for _ in range(count - len(mine))]

    def sum_stats(self, stats: Stats) -> Stats:
        """The update's statistics over every rank: each rank's are its share of the global numbers (token
        shares of the global count), so they add up; a rank with only padding has fewer keys."""
        every: list[Stats | None] = [None] * self.size
        dist.all_gather_object(every, stats, group=self.group)
        total: Stats = {}
        for part in every:
            for key, value in (part or {}).items():
                if key in GLOBAL:
                    total[key] = value
                else:
                    total[key] = total.get(key, 0.0) + value
        return total


@dataclass
class ManyRanks:
    """Rank 0's trainer: its own share of every update, as `local` would train it alone, each call that
    needs every rank ordered first. Any failure of such a call ends the run (`RankLost`, `lost`)."""

    local: OneRank
    ranks: Ranks
    saved_step: int  # the newest checkpoint's step: where `--resume` goes on from
    lost: str | None = None

    def update(self, batch: Batch, step: int, cfg: LearnerSettings) -> Updated:
        local = self.local

        def run() -> Updated:
            order = RankOrder(
                kind="train",
                step=step,
                groups=[encode_group(g) for g in batch.groups],
                learner=cfg.model_dump(mode="json"),
            )
            self.ranks.send(order)
            return run_updates(
                local.engine, batch.groups, cfg, local.pad_id, step, local.reference, self.ranks
            )

        return self._collective(f"step {step}", run)

    def lr(self) -> float | None:
        return self.local.lr()  # every rank's optimizer is set alike, from the same order's settings

    @property
    def adapter_base(self) -> str | None:
        return self.local.adapter_base  # taken before ZeRO partitioned the model: the same on every rank

    def weights(self) -> dict[str, torch.Tensor]:
        if self.local.cfg.zero_stage != 3:  # the full weights are on this rank already
            return cpu_weights(self.local.engine)

        def gather() -> dict[str, torch.Tensor]:
            self.ranks.send(RankOrder(kind="gather"))
            return cpu_weights(self.local.engine)

        return self._collective("gathering the weights", gather)

    def save(self, state: TrainState, tag: str | None) -> Path:
        local = self.local

        def save() -> Path:
            return save_checkpoint(
                local.engine,
                local.tokenizer,
                local.run_dir,
                state,
                local.cfg.keep_checkpoints,
                tag,
                before_save=lambda path: self.ranks.send(RankOrder(kind="save", path=str(path))),
                keep_tagged=local.cfg.keep_tagged_checkpoints,
            )

        path = self._collective("the checkpoint", save)
        self.saved_step = state.step
        return path

    def probe(self, group: TrajectoryGroup, cfg: LearnerSettings) -> str | None:
        return None  # never asked: an update that raises ends the run (RankLost)

    def finite_alone(self, group: TrajectoryGroup, cfg: LearnerSettings) -> bool:
        return True  # cannot tell on one rank: under ZeRO-3 across ranks a forward is a collective

    def close(self) -> None:
        """The other ranks may exit (nothing to tell once one is lost)."""
        if self.lost is not None:
            return
        try:
            self._collective("the stop", lambda: self.ranks.send(RankOrder(kind="stop")))
        except RankLost:
            return  # logged: the process exits non-zero
        dist.destroy_process_group()  # now, not at interpreter exit (see `follow`)

    def _collective(self, what: str, run: Callable[[], T]) -> T:
        """`run` a part every rank takes part in; any failure ends the run, as RankLost naming what to do."""
        try:
            return run()
        except Exception as exc:
            since = f"step {self.saved_step}" if self.saved_step else "the start (no checkpoint yet)"
            error = RankLost(
                f"{what} failed on the learner's ranks — a rank died, cannot be reached, or raised "
                f"({type(exc).__name__}: {str(exc)[:300]}). The run stops here without a new checkpoint; "
                f"`--resume` continues from the last one ({since}) and replays the journal, so no group is "
                "trained twice."
            )
            self.lost = str(error)
            log.error("%s", error)
            raise error from exc


def trainer_for(cfg: LearnerConfig, loaded: Loaded) -> Trainer:
    """Rank 0's trainer: `OneRank`, or `ManyRanks` under a launcher that started several (joining the
    orders' group is a collective: every rank does it right after its engine is built)."""
    ranks = Ranks.join()
    local = OneRank(loaded.engine, loaded.tokenizer, cfg.learner, Path(cfg.run_dir), loaded.reference)
    if ranks is None:
        if cfg.learner.ranks > 1:
            log.warning(
                "learner.ranks is %d but this learner was started alone: training as one rank (`sparkrl up` "
                "starts the ranks under torchrun; elsewhere run `torchrun --nproc-per-node=%d -m "
                "sparkrl.cli learner …`)",
                cfg.learner.ranks,
                cfg.learner.ranks,
            )
        return local
    log.info("learner rank 0 of %d: reads the bus and orders the others", ranks.size)
    return ManyRanks(local, ranks, loaded.state.step)


def follow(cfg: LearnerConfig, resume: bool) -> None:
    """A rank other than the first: the same engine (restored like rank 0's when resuming), then rank 0's
    orders until `stop`. It reads no bus, serves nothing and writes no file of its own but its checkpoint
    partitions; it keeps no state between orders but the engine's."""
    guard = watchdog(cfg.learner.startup_timeout_s)
    loaded = load(cfg, resume)
    ranks = Ranks.join()
    guard.cancel()
    if ranks is None:
        raise RuntimeError("follow() is for the learner's ranks other than the first; this is rank 0 of 1")
    _leave_stops_to_rank_0(ranks.rank)
    pad_id = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    log.info(
        "learner rank %d of %d up at step %d: following rank 0", ranks.rank, ranks.size, loaded.state.step
    )
    while True:
        order = ranks.receive()
        if order.kind == "train":
            groups = [decode_group(data) for data in order.groups]
            settings = LearnerSettings.model_validate(order.learner)
            run_updates(loaded.engine, groups, settings, pad_id, order.step, loaded.reference, ranks)
        elif order.kind == "gather":
            join_gather(loaded.engine)
        elif order.kind == "save":
            save_partitions(loaded.engine, Path(order.path or ""))
        else:
            log.info("learner rank %d: rank 0 says the run is over", ranks.rank)
            break
    # Torn down here, not at interpreter exit (where gloo's threads have aborted the process).
    dist.destroy_process_group()


def _leave_stops_to_rank_0(rank: int) -> None:
    """SIGTERM/SIGINT reach every rank at once (a launcher signals its whole group): rank 0 finishes its
    step and orders the final checkpoint, which needs this rank alive, then `stop`. Until the engine is
    built a signal ends the start at once, as on rank 0; a launcher's SIGKILL still ends a hung rank."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, _frame: object) -> None:
        log.info(
            "learner rank %d: signal %d; rank 0 leads the stop (final checkpoint, then stop)", rank, signum
        )

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
