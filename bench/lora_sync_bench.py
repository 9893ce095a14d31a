"""Bytes per version and sync time with and without LoRA, on the `mid` model of bench/engine_bench.py (50M
parameters, `.cache/mid-countdown`): the learner's weight sync as the product runs it (WeightSender →
gloo → a WeightReceiver in a worker process holding a TorchEngine, which loads each version through its
VersionInstaller, merging an adapter into its base), three ways, in one invocation:

- `full`: no LoRA, the whole model every version (the baseline);
- `lora merged`: LoRA r=16 on every linear layer, `learner.lora.sync: merged` (the merged model travels);
- `lora adapter`: the same adapter, `learner.lora.sync: adapter` (the default: the adapter alone travels,
  the worker merges it).

`broadcast` is the learner's call (transfer + every member's checksum acknowledgement), `loaded` the time
from the broadcast's start until the worker's engine holds the version (received, verified, merged,
copied in). Each version differs (the adapter's B is redrawn) so nothing is cached. Prints a table with
ratios against `full`, then one JSON line.

    .venv/bin/python bench/lora_sync_bench.py [--rank 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from engine_bench import ensure_mid_model

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.settings import LearnerSettings, TorchEngineSettings
from sparkrl.services.common.weight_sync import Received, WeightReceiver, WeightSender
from sparkrl.services.learner.lora import adapter_base, adapter_tensors, lora_layers, merged_state_dict
from sparkrl.services.learner.trainer import learner_model
from sparkrl.services.rollout.install import VersionInstaller
from sparkrl.services.rollout.torch_engine import TorchEngine

TIMEOUT_S = 120.0
CACHE = Path(__file__).resolve().parents[1] / ".cache"


def worker_main(model: str, commands: Any, results: Any) -> None:
    """The worker's side: receive each announced version and load it, as `worker.sync_weights` does."""
    torch.set_num_threads(1)
    engine = TorchEngine(model, TorchEngineSettings(dtype="float32", threads=1))
    installer = VersionInstaller(engine, model)
    receiver = WeightReceiver("w", backend="gloo", timeout_s=TIMEOUT_S)
    results.put("ready")
    while (raw := commands.get()) is not None:
        announcement = WeightAnnouncement.model_validate_json(raw)
        delivery = receiver.receive(announcement)
        assert isinstance(delivery, Received)
        installer.install(delivery.tensors, announcement.version, announcement.adapter_base)
        results.put((time.time(), installer.checksum() == announcement.checksum))
    receiver.close()
    engine.close()


def versions(
    model: Path, rank: int, repeats: int
) -> dict[str, list[tuple[dict[str, torch.Tensor], str | None]]]:
    """Per way, `repeats` distinct versions as the learner's `cpu_weights` gives them (and adapter_base)."""
    full = learner_model(str(model), LearnerSettings())
    lora_cfg = {"r": rank, "alpha": 2.0 * rank}
    adapted = learner_model(str(model), LearnerSettings.model_validate({"lora": lora_cfg}))
    out: dict[str, list[tuple[dict[str, torch.Tensor], str | None]]] = {}
    generator = torch.Generator().manual_seed(0)
    out["full"] = [
        ({n: t.detach() + 1e-3 * i for n, t in full.state_dict().items()}, None) for i in range(repeats)
    ]
    out["lora merged"], out["lora adapter"] = [], []
    for _ in range(repeats):
        with torch.no_grad():  # an adapter after some training: B no longer 0
            for layer in lora_layers(adapted).values():
                b = layer.lora_B["default"].weight
                b.copy_(torch.randn(b.shape, generator=generator) * 0.01)
        out["lora merged"].append((merged_state_dict(adapted), None))
        out["lora adapter"].append((adapter_tensors(adapted), adapter_base(adapted)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = ensure_mid_model(CACHE)
    print(f"model {model}; building the versions (LoRA r={args.rank}, all linear layers)", flush=True)
    ways = versions(model, args.rank, args.repeats)

    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=worker_main, args=(str(model), commands, results), daemon=True)
    worker.start()
    assert results.get(timeout=300) == "ready"
    rows: list[dict[str, Any]] = []
    version = 0
    with WeightSender(backend="gloo", timeout_s=TIMEOUT_S) as sender:
        for way, made in ways.items():
            broadcast_s, loaded_s, nbytes = [], [], 0
            for tensors, base in made:
                version += 1
                announcement = sender.announce(
                    tensors, version=version, epoch=1, members=["w"], adapter_base=base
                )
                sender.published(announcement)
                commands.put(announcement.model_dump_json())
                started = time.time()
                report = sender.broadcast(tensors, announcement)
                loaded_at, held = results.get(timeout=TIMEOUT_S)
                assert held, f"{way}: the worker does not hold version {version}"
                broadcast_s.append(report.seconds)
                loaded_s.append(loaded_at - started)
                nbytes = announcement.total_bytes
            rows.append(
                {
                    "way": way,
                    "bytes": nbytes,
                    "broadcast_s": statistics.median(broadcast_s),
                    "loaded_s": statistics.median(loaded_s),
                }
            )
            print(
                f"  {way}: {nbytes / 1e6:.1f} MB, loaded in {rows[-1]['loaded_s']:.3f}s (median)", flush=True
            )
    commands.put(None)
    worker.join(30)

    base = rows[0]
    print(f"\nmid model, LoRA r={args.rank} on every linear layer, gloo, 1 worker, median of {args.repeats}")
    print(
        f"{'way':<14}{'MB/version':>12}{'x full':>9}{'broadcast s':>13}{'x full':>9}"
        f"{'loaded s':>10}{'x full':>9}"
    )
    for row in rows:
        print(
            f"{row['way']:<14}{row['bytes'] / 1e6:>12.2f}{row['bytes'] / base['bytes']:>9.3f}"
            f"{row['broadcast_s']:>13.3f}{row['broadcast_s'] / base['broadcast_s']:>9.3f}"
            f"{row['loaded_s']:>10.3f}{row['loaded_s'] / base['loaded_s']:>9.3f}"
        )
    print(json.dumps({"rank": args.rank, "repeats": args.repeats, "rows": rows}))


if __name__ == "__main__":
    main()
