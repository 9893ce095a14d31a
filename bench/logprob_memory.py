"""Peak memory per token of the learner's log-prob + entropy pass with its backward, at V = 151,936: the
full-logits path the learner used to take (`full_logits_reference`) against the chunked one
(services/learner/logprobs.py `token_logp_and_entropy`).

    .venv/bin/python bench/logprob_memory.py [--tokens 512 2048] [--device cpu|cuda] [--entropy-grad]

The model is a small random Qwen2 built in memory (no download): a few layers, hidden 256, the real
vocabulary. Each case runs in a fresh child process: it warms up with a short pass (so the gradients exist
and the kernels are loaded), then measures one pass over a micro-batch of `tokens` targets. As in the
learner's train step, the old path's returned logits stay referenced until the backward is done.

- CPU: peak RSS growth over the pass. glibc is told to mmap every allocation above 64 KiB
  (`MALLOC_MMAP_THRESHOLD_`), so a freed tensor leaves RSS at once; the child trims the heap and resets the
  kernel's high-water mark (`5` into /proc/self/clear_refs) before the pass, then reads VmHWM − VmRSS.
  (`tracemalloc` does not see torch's allocations.)
- CUDA: `torch.cuda.max_memory_allocated()` − `memory_allocated()` around the pass.

`bytes/token` is the peak over the pass divided by its tokens (it includes what does not grow with T);
`marginal` is the growth between the shortest and the longest case per added token: what V × T costs.
The seconds printed are the pass's wall time, slowed on CPU by the mmap setting: not a speed benchmark.
The last line is one JSON object for machines to read.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

VOCAB = 151_936
PATHS = ("full", "chunked")


def tiny_qwen(layers: int, hidden: int, max_positions: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config)


def micro_batch(tokens: int, device: str) -> Any:
    """One row of `tokens` + 1 ids: every position but the last predicts a generated token."""
    from sparkrl.services.learner.batch import MicroBatch

    g = torch.Generator().manual_seed(tokens)
    input_ids = torch.randint(VOCAB, (1, tokens + 1), generator=g)
    per_token = torch.zeros(1, tokens)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        mask=torch.ones(1, tokens, dtype=torch.bool),
        rollout_logp=per_token,
        topk_ids=torch.zeros(1, tokens, 1, dtype=torch.long),
        topk_logp=per_token[..., None],
        advantages=per_token,
        temperature=torch.ones(1, 1, 1),
    ).to(device)


def one_pass(model: torch.nn.Module, mb: Any, path: str, entropy_grad: bool) -> None:
    from sparkrl.services.learner.logprobs import full_logits_reference, token_logp_and_entropy

    if path == "full":
        logp, entropy, _logits = full_logits_reference(model, mb, entropy_grad)  # held, as train_step did
    else:
        logp, entropy = token_logp_and_entropy(model, mb, entropy_grad)
    loss = (logp * mb.mask).sum() / mb.mask.sum()
    if entropy_grad:
        loss = loss - 0.01 * (entropy * mb.mask).sum() / mb.mask.sum()
    loss.backward()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def child(case: dict[str, Any]) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    device, path, tokens = case["device"], case["path"], case["tokens"]
    torch.manual_seed(0)
    model = tiny_qwen(case["layers"], case["hidden"], max(case["tokens"], 64) + 1).to(device)
    one_pass(
        model, micro_batch(64, device), path, case["entropy_grad"]
    )  # gradients allocated, kernels loaded
    model.zero_grad(set_to_none=False)
    mb = micro_batch(tokens, device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # VmHWM := VmRSS
        base = _status_kib("VmRSS") * 1024
    started = time.perf_counter()
    one_pass(model, mb, path, case["entropy_grad"])
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _status_kib("VmHWM") * 1024 - base
    return {**case, "peak_bytes": peak, "seconds": round(time.perf_counter() - started, 2)}


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(case)], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048], help="targets per micro-batch")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument(
        "--entropy-grad", action="store_true", help="entropy with its gradient (entropy bonus)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    common = {"device": args.device, "layers": args.layers, "hidden": args.hidden}
    common["entropy_grad"] = args.entropy_grad
    model = f"{args.layers} layers, hidden {args.hidden}"
    print(f"V = {VOCAB:,}, {model}, {args.device}: log-prob + entropy + backward, peak memory over the pass")
    results = {
        (p, t): run_case({**common, "path": p, "tokens": t}) for t in sorted(args.tokens) for p in PATHS
    }
    print(
        f"{'tokens':>7} {'full MiB':>10} {'chunked MiB':>12} {'full B/tok':>11} {'chunked B/tok':>14} ratio"
    )
    rows = []
    for t in sorted(args.tokens):
        full, chunked = results["full", t]["peak_bytes"], results["chunked", t]["peak_bytes"]
        ratio = full / max(chunked, 1)
        seconds = (results["full", t]["seconds"], results["chunked", t]["seconds"])
        print(
            f"{t:>7} {full / 2**20:>10.0f} {chunked / 2**20:>12.0f} {full / t:>11,.0f} {chunked / t:>14,.0f} "
            f"{ratio:5.1f}x   ({seconds[0]} s vs {seconds[1]} s)"
        )
        rows.append(
            {
                "tokens": t,
                "full_bytes": full,
                "chunked_bytes": chunked,
                "full_bytes_per_token": full / t,
                "chunked_bytes_per_token": chunked / t,
                "ratio": ratio,
                "full_s": seconds[0],
                "chunked_s": seconds[1],
            }
        )
    summary: dict[str, Any] = {"bench": "logprob_memory", "vocab": VOCAB, **common, "cases": rows}
    lo, hi = min(args.tokens), max(args.tokens)
    if hi > lo:
        marginal = {
            p: (results[p, hi]["peak_bytes"] - results[p, lo]["peak_bytes"]) / (hi - lo) for p in PATHS
        }
        summary["marginal_bytes_per_token"] = marginal
        print(
            f"marginal bytes per added token ({lo} → {hi}): full {marginal['full']:,.0f}, "
            f"chunked {marginal['chunked']:,.0f} ({marginal['full'] / max(marginal['chunked'], 1):.1f}x); "
            f"one float32 vocabulary row is {4 * VOCAB:,} B"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
