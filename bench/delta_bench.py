"""Delta weight sync (`sync.delta`, issue 50 item 4): how much of a policy changes per RL step, and what a
version costs sent whole and as a delta, in one invocation.

Two models built here: the demo's tiny model (`.cache/tiny-countdown`) and a ≈ 50M Llama (random
weights, transformers' own classes). Each takes `--steps` AdamW steps at an RL learning rate (`--lr`,
1e-6 by default) on a language-model loss over random tokens, its master weights in float32. Per step:

- the fraction of elements whose bits changed: of the float32 weights, and of their bf16 copy (what a
  bf16 learner, or a bf16 shadow of a float32 one, would send);
- the bytes of a version whole and as a delta (`delta.delta_tensors`), bf16 and float32;
- seconds per version through the real path — `WeightSender.announce` (hashing, the diff) and
  `broadcast` over gloo to one `WeightReceiver` process (which applies the delta and checks the whole
  version's checksum) — with `delta` off (the baseline) and on, the bf16 copy.

    .venv/bin/python bench/delta_bench.py [--steps 8] [--lr 1e-6]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.weight_sync import WeightReceiver, WeightSender, distinct_tensors
from sparkrl.services.common.weight_sync.delta import changed_fraction, delta_tensors

TINY = Path(".cache/tiny-countdown")
TIMEOUT_S = 120.0


def fifty_million() -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=32_000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def receiver_main(delta: bool, commands: Any, results: Any) -> None:
    receiver = WeightReceiver("w0", timeout_s=TIMEOUT_S, delta=delta)
    results.put("ready")
    while (command := commands.get()) is not None:
        receiver.receive(WeightAnnouncement.model_validate_json(command))
        results.put("ok")
    receiver.close()


def versions(model: torch.nn.Module, steps: int, lr: float) -> list[dict[str, torch.Tensor]]:
    """The float32 weights after each of `steps` AdamW steps (the first entry: before any)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    out = [{n: t.detach().clone() for n, t in distinct_tensors(model.state_dict()).items()}]
    for _ in range(steps):
        ids = torch.randint(0, vocab, (4, 64), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        out.append({n: t.detach().clone() for n, t in distinct_tensors(model.state_dict()).items()})
    return out


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def sync_seconds(states: list[dict[str, torch.Tensor]], delta: bool) -> list[float]:
    """Seconds per version (announce + broadcast + the receiver's acknowledgement), every version."""
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    process = ctx.Process(target=receiver_main, args=(delta, commands, results), daemon=True)
    process.start()
    assert results.get(timeout=TIMEOUT_S) == "ready"
    seconds = []
    try:
        with WeightSender(timeout_s=TIMEOUT_S, bucket_bytes=64 << 20, delta=delta) as sender:
            for version, state in enumerate(states):
                started = time.perf_counter()
                announcement = sender.announce(state, version=version, epoch=1, members=["w0"])
                commands.put(announcement.model_dump_json())
                sender.broadcast(state, announcement)
                assert results.get(timeout=TIMEOUT_S) == "ok"
                seconds.append(time.perf_counter() - started)
    finally:
        commands.put(None)
        process.join(timeout=30)
    return seconds


def measure(name: str, model: torch.nn.Module, steps: int, lr: float) -> dict[str, Any]:
    states32 = versions(model, steps, lr)
    states16 = [
        {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in s.items()} for s in states32
    ]
    rows = []
    for step in range(1, steps + 1):
        rows.append({
            "changed_f32": changed_fraction(states32[step - 1], states32[step]),
            "changed_bf16": changed_fraction(states16[step - 1], states16[step]),
            "delta_bytes_f32": nbytes(delta_tensors(states32[step - 1], states32[step])),
            "delta_bytes_bf16": nbytes(delta_tensors(states16[step - 1], states16[step])),
        })  # fmt: skip
    whole16, whole32 = nbytes(states16[0]), nbytes(states32[0])
    whole_s = sync_seconds(states16, delta=False)
    delta_s = sync_seconds(states16, delta=True)
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
    later = slice(1, None)  # the first version goes whole either way
    result = {
        "parameters": sum(t.numel() for t in states32[0].values()),
        "changed_fraction": {"float32": mean["changed_f32"], "bf16": mean["changed_bf16"]},
        "bytes_per_version": {
            "bf16_whole": whole16,
            "bf16_delta": mean["delta_bytes_bf16"],
            "f32_whole": whole32,
            "f32_delta": mean["delta_bytes_f32"],
        },
        "seconds_per_version_bf16": {
            "whole": sum(whole_s[later]) / len(whole_s[later]),
            "delta": sum(delta_s[later]) / len(delta_s[later]),
        },
    }
    print(f"\n{name}: {result['parameters'] / 1e6:.1f}M parameters, {steps} AdamW steps at lr {lr:g}")
    print(f"  elements changed a step: float32 {mean['changed_f32']:.2%}, bf16 {mean['changed_bf16']:.2%}")
    for kind, whole in (("bf16", whole16), ("f32", whole32)):
        sent = mean[f"delta_bytes_{kind}"]
        print(
            f"  bytes a version, {kind}: whole {whole / 1e6:.1f} MB, delta {sent / 1e6:.2f} MB "
            f"({sent / whole:.3f}×)"
        )
    s = result["seconds_per_version_bf16"]
    print(f"  seconds a version, bf16, gloo to one worker: whole {s['whole']:.3f}, delta {s['delta']:.3f} "
          f"({s['delta'] / s['whole']:.2f}×)")  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-6)
    args = parser.parse_args()
    result = {}
    if TINY.is_dir():
        result["demo"] = measure(
            "the demo's tiny model", AutoModelForCausalLM.from_pretrained(TINY), args.steps, args.lr
        )
    else:
        print(f"{TINY} is missing (make demo builds it): the demo's rows are left out")
    result["50M"] = measure("a 50M Llama", fifty_million(), args.steps, args.lr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
