"""A narrower trajectory wire (issue 50, item 3): what each precision of the log-prob fields costs in bytes
and in Lp-Reg, against the float32 wire, in one invocation.

For each `rollout.wire` choice (log-probs, top-k log-probs in float32, float16 or bfloat16; ids always
as narrow as the vocabulary allows) this prints:

- bytes per generated token of a real encoded group (`encode_group`) at k = 20, for the demo's
  vocabulary and for V = 151,936 (Qwen's), against the float32 wire before issue 50 (int32 ids);
- Lp-Reg's proxy from the top-k as the learner computes it (`proxy_logp_from_topk`): positions where
  it is inexact, and its largest change on the kept tokens against the float32 wire;
- the Lp-Reg loss (`lp_reg_loss`, ρ = 0.2) and its gradient with respect to the current log-probs,
  against the float32 wire's: relative differences, and the regularized tokens that changed.

The distributions: the demo's tiny model (`.cache/tiny-countdown`, built by `make demo`) sampling
countdown completions at temperature 1 (its real log-probs), and at V = 151,936 synthetic logits
(a long normal tail under a head of 8 plausible tokens). The rounding
goes through the codec itself (`encode_group` then `decode_group`).

    .venv/bin/python bench/wire_bench.py [--tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import msgpack
import numpy as np
import torch

from sparkrl.proto import MAGIC, TrajectoryGroup
from sparkrl.proto.codec import TOKEN_FIELDS, Wire, decode_group, encode_group, header_meta
from sparkrl.proto.testing import random_group
from sparkrl.services.common.losses.lp_reg import LpRegLoss, lp_reg_loss
from sparkrl.services.learner.proxy import proxy_logp_from_topk

K = 20
CHOICES = [("float32", "float32"), ("float32", "float16"), ("float32", "bfloat16"),
           ("float16", "float16"), ("bfloat16", "bfloat16")]  # fmt: skip
TINY = Path(".cache/tiny-countdown")


def demo_logits(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [N, V] of the tiny model along its own sampled countdown completions, sampled ids [N])."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparkrl.services.common.tasks import countdown

    model = AutoModelForCausalLM.from_pretrained(TINY).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    import random

    problems = random.Random(0)
    rows, ids = [], []
    torch.manual_seed(0)
    while len(rows) < tokens:
        prompt = countdown.format_prompt(countdown.generate_problem(problems))
        start = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                start, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=32, output_scores=True,
                return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
        for step, scores in enumerate(out.scores):
            rows.append(torch.log_softmax(scores[0].float(), dim=-1))
            ids.append(out.sequences[0, start.shape[1] + step])
    return torch.stack(rows)[:tokens], torch.stack(ids)[:tokens]


def synthetic_logits(tokens: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """LM-like rows at V = `vocab`: a long normal tail (σ = 2) under a head of 8 candidates raised by 8–20
    (an LM's few plausible next tokens, of which sampling often takes a rare one)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(tokens, vocab, generator=g) * 2.0
    head = torch.randint(0, vocab, (tokens, 8), generator=g)
    logits.scatter_add_(1, head, 8.0 + 12.0 * torch.rand(tokens, 8, generator=g))
    logp = torch.log_softmax(logits, dim=-1)
    ids = torch.multinomial(logp.exp(), 1, generator=g).squeeze(1)
    return logp, ids


def through_wire(logp: torch.Tensor, ids: torch.Tensor, wire: Wire) -> dict[str, torch.Tensor]:
    """The rollout's numbers after the codec: sampled log-probs, top-k ids and log-probs."""
    N, V = logp.shape
    top = torch.topk(logp, K, dim=-1)
    group = random_group(np.random.default_rng(0), n=1, T=N, k=K, vocab_size=V, max_new_tokens=N)
    c = group.completions[0]
    c.token_ids[:] = ids.numpy()
    c.logprobs[:] = logp.gather(1, ids[:, None]).squeeze(1).numpy()
    c.topk_ids[:] = top.indices.numpy()
    c.topk_logprobs[:] = top.values.numpy()
    payload = encode_group(group, wire)
    back = decode_group(payload).completions[0]
    before = len(legacy_payload(group))
    assert decode_group(legacy_payload(group)) == group  # the decoder still reads the older layout
    return {
        "logp": torch.from_numpy(np.array(back.logprobs)),
        "topk_ids": torch.from_numpy(np.array(back.topk_ids)).long(),
        "topk_logp": torch.from_numpy(np.array(back.topk_logprobs)),
        "bytes_per_token": torch.tensor(len(payload) / N),
        "bytes_before": torch.tensor(before / N),
    }


def legacy_payload(group: TrajectoryGroup) -> bytes:
    """The group as the codec wrote it before issue 50: int32 ids, float32 log-probs, no `wire` key."""
    header = {"schema_version": 1, "prompt_len": len(group.prompt_token_ids),
              "lengths": [c.num_tokens for c in group.completions], "group": header_meta(group)}  # fmt: skip
    packed = msgpack.packb(header, use_bin_type=True)
    parts = [MAGIC, struct.pack("<I", len(packed)), packed, b"\0" * (-(12 + len(packed)) % 8)]
    parts.append(group.prompt_token_ids.astype("<i4").tobytes())
    for name, dtype in TOKEN_FIELDS:
        parts.extend(getattr(c, name).astype(dtype).tobytes() for c in group.completions)
    return b"".join(parts)


def lp_reg(numbers: dict[str, torch.Tensor], ids: torch.Tensor, current: torch.Tensor, adv: torch.Tensor):
    proxy, exact = proxy_logp_from_topk(ids[None], numbers["topk_ids"][None], numbers["topk_logp"][None])
    logp = current[None].clone().requires_grad_(True)
    mask = torch.ones_like(logp, dtype=torch.bool)
    loss, metrics = lp_reg_loss(
        logp, numbers["logp"][None], adv[None], mask, LpRegLoss(rho=0.05), proxy_logp=proxy
    )
    loss.backward()
    return proxy[0], exact[0], loss.detach(), logp.grad[0], metrics


def compare(name: str, logp: torch.Tensor, ids: torch.Tensor) -> dict[str, dict[str, float]]:
    g = torch.Generator().manual_seed(2)
    sampled = logp.gather(1, ids[:, None]).squeeze(1)
    current = sampled + 0.05 * torch.randn(sampled.shape, generator=g)  # the policy one update later
    adv = torch.where(torch.rand(sampled.shape, generator=g) < 0.5, -1.0, 1.0)
    base = lp_reg(through_wire(logp, ids, Wire()), ids, current, adv)
    rows = {}
    for lp_kind, topk_kind in CHOICES:
        numbers = through_wire(logp, ids, Wire(logprobs=lp_kind, topk_logprobs=topk_kind))  # type: ignore[arg-type]
        proxy, exact, loss, grad, metrics = lp_reg(numbers, ids, current, adv)
        kept = torch.isfinite(proxy) & torch.isfinite(base[0])
        rows[f"{lp_kind}/{topk_kind}"] = {
            "bytes_per_token": float(numbers["bytes_per_token"]),
            "proxy_inexact": int((~exact).sum()),
            "proxy_filter_flips": int((torch.isfinite(proxy) != torch.isfinite(base[0])).sum()),
            "proxy_max_abs_diff": float((proxy[kept] - base[0][kept]).abs().max()) if kept.any() else 0.0,
            "loss_rel_diff": float((loss - base[2]).abs() / base[2].abs().clamp(min=1e-12)),
            "grad_rel_l2": float((grad - base[3]).norm() / base[3].norm().clamp(min=1e-12)),
            "reg_tokens": int(metrics["reg_tokens"]),
        }
    before = float(through_wire(logp, ids, Wire())["bytes_before"])
    print(f"\n{name}: {logp.shape[0]} tokens, V = {logp.shape[1]}, k = {K}; the wire before issue 50 (int32 "
          f"ids, float32): {before:.1f} B/token")  # fmt: skip
    head = [
        "logprobs/topk",
        "B/token",
        "× before",
        "inexact",
        "flips",
        "proxy Δmax",
        "loss Δrel",
        "grad Δrel",
    ]
    print(f"{head[0]:<20}" + "".join(f"{h:>11}" for h in head[1:]) + f"{'reg':>5}")
    for key, r in rows.items():
        size = r["bytes_per_token"]
        diffs = [f"{r[k]:.2e}" for k in ("proxy_max_abs_diff", "loss_rel_diff", "grad_rel_l2")]
        cells = [
            f"{size:.1f}",
            f"{size / before:.2f}",
            str(r["proxy_inexact"]),
            str(r["proxy_filter_flips"]),
            *diffs,
        ]
        print(f"{key:<20}" + "".join(f"{c:>11}" for c in cells) + f"{r['reg_tokens']:5d}")
    rows["before"] = {"bytes_per_token": before}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    result = {}
    if TINY.is_dir():
        result["demo"] = compare("the demo's tiny model", *demo_logits(args.tokens))
    else:
        print(f"{TINY} is missing (make demo builds it): the demo's rows are left out")
    result["V=151936"] = compare("synthetic, Qwen's vocabulary", *synthetic_logits(args.tokens, 151_936))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
