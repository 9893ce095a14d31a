"""The weights checksum's speed (issue 50, item 1): the tree (`sparkrl.proto.weights`: SHA-256 leaves of
4 MiB, hashed on a pool of threads) against the baseline, the checksum before it: blake2b-256 over every
byte in manifest order, on one core. Both over the same transformer-shaped bf16 state dict in one
invocation, best of `--repeats`, as GB/s and as seconds per version of a 0.5B and an 8B bf16 policy
(the cost model's sizes: 0.99 GB and 16.1 GB). Prints a table, then one JSON line.

    .venv/bin/python bench/checksum_bench.py [--gb 1.0] [--repeats 3]

Pause any background experiment first (SIGSTOP): the threads' rows measure free cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Callable

import torch

from sparkrl.proto.weights import CHECKSUM_ALGORITHM
from sparkrl.services.common.weight_sync.hashing import ParallelHasher
from sparkrl.services.common.weight_sync.manifest import raw_bytes

GB = 1e9
POLICY_GB = {"0.5B": 0.99, "8B": 16.1}  # bf16 bytes of Qwen2.5-0.5B and an 8B policy (docs/benchmarks.md)


def model_like(total_gb: float) -> list[memoryview]:
    """bf16 tensors shaped as a transformer's: an embedding (~15%), big projections and small norms."""
    hidden = 2048
    embed_rows = int(total_gb * GB * 0.15 / (hidden * 2))
    tensors = [torch.randn(embed_rows, hidden).to(torch.bfloat16)]
    layer_bytes = 4 * hidden * hidden * 2
    for _ in range(max(1, int(total_gb * GB * 0.85 / layer_bytes))):
        tensors += [
            torch.randn(4 * hidden, hidden).to(torch.bfloat16),
            torch.randn(hidden).to(torch.bfloat16),
        ]
    return [raw_bytes(t) for t in tensors]


def blake2b_sequential(tensors: list[memoryview]) -> str:
    """The checksum before issue 50: one blake2b-256 over every tensor's bytes in order, one core."""
    digest = hashlib.blake2b(digest_size=32)
    for data in tensors:
        digest.update(data)
    return digest.hexdigest()


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="state dict size, GB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tensors = model_like(args.gb)
    size = sum(len(t) for t in tensors)
    cores = len(os.sched_getaffinity(0))
    rows: dict[str, float] = {
        "blake2b, 1 core (before)": best_seconds(lambda: blake2b_sequential(tensors), args.repeats)
    }
    for threads in sorted({1, 2, cores}):
        hasher = ParallelHasher(threads)
        try:
            rows[f"{CHECKSUM_ALGORITHM}, {threads} thread(s)"] = best_seconds(
                lambda h=hasher: h.checksum(tensors), args.repeats
            )
        finally:
            hasher.close()
    base = rows["blake2b, 1 core (before)"]
    print(f"{size / GB:.2f} GB in {len(tensors)} bf16 tensors, {cores} cores, best of {args.repeats}")
    print(f"{'checksum':<36} {'GB/s':>6} {'× before':>9} " + " ".join(f"{k + ' s':>8}" for k in POLICY_GB))
    result = {}
    for name, seconds in rows.items():
        rate = size / GB / seconds
        per_version = {k: gb / rate for k, gb in POLICY_GB.items()}
        print(
            f"{name:<36} {rate:6.2f} {base / seconds:9.2f} "
            + " ".join(f"{v:8.1f}" for v in per_version.values())
        )
        result[name] = {"gb_per_s": round(rate, 3), "ratio": round(base / seconds, 2),
                        "seconds_per_version": {k: round(v, 2) for k, v in per_version.items()}}  # fmt: skip
    print(json.dumps({"bytes": size, "cores": cores, "rows": result}))


if __name__ == "__main__":
    main()
