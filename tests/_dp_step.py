"""One learner step's update on a fixed batch, as one rank of `torchrun --nproc-per-node N` (or alone):
what tests/test_learner_ranks.py compares between one rank and two. The product's own path: rank 0's
trainer (`ranks.trainer_for`: one rank, or the N ranks' orders) and the other ranks' `follow`. Writes,
from rank 0, the step's statistics and every parameter after it to OUT (a torch file)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import torch

from sparkrl.proto.testing import random_group
from sparkrl.services.common.settings import load_settings
from sparkrl.services.common.settings.roles import LearnerConfig
from sparkrl.services.learner import logprobs
from sparkrl.services.learner.ledger import Batch
from sparkrl.services.learner.ranks import follow, trainer_for, world
from sparkrl.services.learner.trainer import load

VOCAB = 260  # the tiny model's byte-level vocabulary


def fixed_groups(count: int = 6) -> list:
    """Groups of different lengths (so micro-batches differ), the same on every rank and every run."""
    rng = np.random.default_rng(1234)
    groups = []
    for index in range(count):
        group = random_group(rng, n=4, T=4 + index, k=8, vocab_size=VOCAB)
        rewards = [1.0, 0.0, float(index % 2), 0.5]
        groups.append(
            group.model_copy(update={"prompt_token_ids": group.prompt_token_ids[:10], "rewards": rewards})
        )
    return groups


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--zero", type=int, required=True)
    parser.add_argument("--set", nargs="*", default=[])
    args = parser.parse_args()
    logprobs.CHUNK_BYTES = 4 * VOCAB * 5  # chunks of 5 positions: several per micro-batch, a ragged last
    tree = load_settings(
        "smoke",
        [
            f"model={args.model}",
            f"learner.zero_stage={args.zero}",
            "learner.lr=1e-4",
            "learner.micro_batch_tokens=48",  # several micro-batches, an odd number of them
            "learner.threads=1",
            *args.set,
        ],
    )
    cfg = LearnerConfig.of(tree)
    if world()[0] != 0:
        follow(cfg, resume=False)  # rank 0's orders: the update, the gather of the weights, the stop
        return
    size = world()[1]
    trainer = trainer_for(cfg, load(cfg, resume=False))
    stats = trainer.update(Batch(fixed_groups(), []), 1, cfg.learner).row()
    weights = trainer.weights()  # under ZeRO-3 across ranks, a gather every rank takes part in
    trainer.close()  # the other ranks' `follow` ends
    torch.save({"stats": stats, "weights": weights, "size": size}, Path(args.out))
    print(f"rank 0/{size} pid {os.getpid()}: {stats}", flush=True)


if __name__ == "__main__":
    main()
