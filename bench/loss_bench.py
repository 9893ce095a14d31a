"""Lp-Reg proxy from the streamed top-k vs. the reference way (min-p over the full vocabulary from logits),
and the trajectory codec's size and speed.

    .venv/bin/python bench/loss_bench.py [--tokens 2048] [--vocab 151936] [--k 64] [--repeats 3]

Both proxy paths get the same inputs and are timed in the same run; memory is the peak of bytes held by
tensors the path itself allocates (inputs excluded), tracked op by op with a dispatch mode, so it is
exact on CPU and needs no allocator statistics. The last line is one JSON object for machines to read.
"""

from __future__ import annotations

import argparse
import json
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sparkrl.proto import decode_group, encode_group
from sparkrl.proto.testing import random_group
from sparkrl.services.learner.proxy import proxy_logp_from_logits, proxy_logp_from_topk


class PeakTensorMemory(TorchDispatchMode):
    """Peak bytes of live storages created inside the `with` block. Views share their storage, and views
    of the inputs (`existing`) cost nothing."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._inputs = {t.untyped_storage().data_ptr() for t in existing}
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if key in self._seen or key in self._inputs or storage.nbytes() == 0:
            return
        self._seen.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, storage.nbytes())

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


def best_time(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def peak_memory(fn: Callable[[], Any], inputs: list[torch.Tensor]) -> int:
    with PeakTensorMemory(inputs) as tracker:
        fn()
    return tracker.peak


def proxy_inputs(tokens: int, vocab: int, k: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Realistic logits (a few likely tokens over a long tail), sampled ids, and their top-k."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, tokens, vocab, generator=gen) * 2.0  # [1, T, V]
    logits[..., :8] += 8.0  # a handful of strong candidates per position, as in a trained LM
    logp = torch.log_softmax(logits, dim=-1)
    token_ids = torch.multinomial(logp[0].exp(), 1, generator=gen).view(1, tokens)  # [1, T]
    topk_logp, topk_ids = torch.topk(logp, k, dim=-1)  # [1, T, k] each, sorted descending
    return {"logits": logits, "token_ids": token_ids, "topk_ids": topk_ids, "topk_logp": topk_logp}


def bench_proxy(tokens: int, vocab: int, k: int, repeats: int) -> dict[str, float]:
    data = proxy_inputs(tokens, vocab, k)

    def by_logits() -> torch.Tensor:
        return proxy_logp_from_logits(data["logits"], data["token_ids"])

    def by_topk() -> tuple[torch.Tensor, torch.Tensor]:
        return proxy_logp_from_topk(data["token_ids"], data["topk_ids"], data["topk_logp"])

    reference, (streamed, exact) = by_logits(), by_topk()
    agree = exact & torch.isfinite(reference)
    max_err = (reference[agree] - streamed[agree]).abs().max().item() if agree.any() else 0.0
    return {
        "logits_s": best_time(by_logits, repeats),
        "topk_s": best_time(by_topk, 20 * repeats),  # cheap: more tries so noise cannot flatter the ratio
        "logits_peak_bytes": peak_memory(by_logits, list(data.values())),
        "topk_peak_bytes": peak_memory(by_topk, list(data.values())),
        "exact_frac": exact.float().mean().item(),
        "max_abs_err_where_exact": max_err,
    }


def bench_codec(k: int, n: int = 8, T: int = 1024, repeats: int = 10) -> dict[str, float]:
    group = random_group(np.random.default_rng(0), n=n, T=T, k=k)
    payload = encode_group(group)
    mb = len(payload) / 1e6
    return {
        "k": k,
        "bytes_per_token": len(payload) / group.num_tokens,
        "encode_MBps": mb / best_time(lambda: encode_group(group), repeats),
        "decode_MBps": mb / best_time(lambda: decode_group(payload), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="generated tokens in the batch (B·T)")
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary size (Qwen2.5: 151,936)")
    parser.add_argument("--k", type=int, default=64, help="top-k streamed by the rollout")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    threads = torch.get_num_threads()
    print(f"proxy: {args.tokens} tokens, V={args.vocab:,}, k={args.k}, torch threads={threads}")
    proxy = bench_proxy(args.tokens, args.vocab, args.k, args.repeats)
    speedup = proxy["logits_s"] / proxy["topk_s"]
    memory_ratio = proxy["logits_peak_bytes"] / max(proxy["topk_peak_bytes"], 1)
    print(f"{'path':<28}{'time (ms)':>12}{'peak extra (MiB)':>18}")
    for label, key in (("logits (reference)", "logits"), ("top-k (streamed)", "topk")):
        seconds, peak = proxy[f"{key}_s"], proxy[f"{key}_peak_bytes"]
        print(f"{label:<28}{seconds * 1e3:>12.2f}{peak / 2**20:>18.3f}")
    print(f"{'ratio logits / top-k':<28}{speedup:>12.0f}{memory_ratio:>18.0f}")
    print(
        f"top-k exact at {proxy['exact_frac']:.1%} of positions; "
        f"max |error| there {proxy['max_abs_err_where_exact']:.2e}"
    )

    print("\ncodec (8 completions × 1024 tokens, validated encode/decode)")
    print(f"{'k':>4}{'bytes/token':>14}{'encode MB/s':>14}{'decode MB/s':>14}")
    codec = [bench_codec(k) for k in (20, 64)]
    for row in codec:
        print(
            f"{row['k']:>4}{row['bytes_per_token']:>14.1f}{row['encode_MBps']:>14.0f}{row['decode_MBps']:>14.0f}"
        )

    summary = {
        "proxy_speedup": round(speedup, 1),
        "proxy_memory_ratio": round(memory_ratio, 1),
        "proxy_logits_ms": round(proxy["logits_s"] * 1e3, 2),
        "proxy_topk_ms": round(proxy["topk_s"] * 1e3, 3),
        "proxy_exact_frac": round(proxy["exact_frac"], 4),
        "tokens": args.tokens,
        "vocab": args.vocab,
        "k": args.k,
    }
    for row in codec:
        summary[f"codec_k{row['k']}_bytes_per_token"] = round(row["bytes_per_token"], 1)
        summary[f"codec_k{row['k']}_encode_MBps"] = round(row["encode_MBps"])
        summary[f"codec_k{row['k']}_decode_MBps"] = round(row["decode_MBps"])
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
