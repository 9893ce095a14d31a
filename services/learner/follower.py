"""A learner rank other than the first (`learner.ranks` > 1): it builds the same engine, then does what
rank 0 orders (ranks.py) until the run is over. It reads no bus, serves nothing and writes no file of
its own but its checkpoint partitions; it keeps no state between orders but the engine's."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import torch.distributed as dist

from sparkrl.services.common.settings import SparkSettings
from sparkrl.services.learner.checkpoint import join_gather, save_partitions
from sparkrl.services.learner.ledger import Batch
from sparkrl.services.learner.ranks import Ranks, order_groups, order_settings
from sparkrl.services.learner.startup import watchdog
from sparkrl.services.learner.update import compute_update

log = logging.getLogger("sparkrl.learner")


def follow(cfg: SparkSettings, resume: bool) -> None:
    """Engine (restored like rank 0's when resuming), then rank 0's orders until `stop`."""
    from sparkrl.services.learner.service import setup_engine

    guard = watchdog(cfg.learner.startup_timeout_s)
    engine, tokenizer, state, _, reference = setup_engine(cfg, resume)
    ranks = Ranks.join()
    guard.cancel()
    if ranks is None:
        raise RuntimeError("follow() is for the learner's ranks other than the first; this is rank 0 of 1")
    _leave_stops_to_rank_0(ranks.rank)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    log.info("learner rank %d of %d up at step %d: following rank 0", ranks.rank, ranks.size, state.step)
    while True:
        order = ranks.receive()
        if order.kind == "train":
            batch = Batch(order_groups(order), [], 0, 0.0)
            compute_update(engine, batch, order_settings(order), pad_id, order.step, reference, ranks=ranks)
        elif order.kind == "gather":
            join_gather(engine)
        elif order.kind == "save":
            save_partitions(engine, Path(order.path or ""))
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
