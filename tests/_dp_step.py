"""One learner update on a fixed batch, as one rank of `torchrun --nproc-per-node N` (or alone): what
tests/test_learner_ranks.py compares between one rank and two. Writes, from rank 0, the step's
statistics and every parameter after it to OUT (a torch file), for each ZeRO stage asked for."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import torch

from sparkrl.proto.testing import random_group
from sparkrl.services.common.modeling import load_model, load_tokenizer
from sparkrl.services.common.settings import load_settings
from sparkrl.services.learner import logprobs
from sparkrl.services.learner.checkpoint import cpu_weights
from sparkrl.services.learner.collect import Batch
from sparkrl.services.learner.ranks import Ranks, world
from sparkrl.services.learner.trainer import build_engine, init_distributed
from sparkrl.services.learner.update import compute_update

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
    cfg = load_settings(
        "smoke",
        [
            f"model={args.model}",
            f"learner.zero_stage={args.zero}",
            "learner.lr=1e-4",
            "learner.micro_batch_tokens=48",  # several micro-batches, an odd number of them
            "learner.threads=1",
            *args.set,
        ],
    ).learner
    torch.manual_seed(0)
    torch.set_num_threads(1)
    init_distributed(cfg)
    engine = build_engine(load_model(args.model, "float32", "cpu", cfg.attention), cfg)
    ranks = Ranks.join()
    pad = load_tokenizer(args.model).pad_token_id or 0
    stats = compute_update(engine, Batch(fixed_groups(), [], 0, 0.0), cfg, pad, 1, ranks=ranks)
    weights = cpu_weights(engine)  # a gather on every rank under ZeRO-3
    rank, size = world()
    if rank == 0:
        torch.save({"stats": stats, "weights": weights, "size": size}, Path(args.out))
    print(f"rank {rank}/{size} pid {os.getpid()}: {stats}", flush=True)


if __name__ == "__main__":
    main()
