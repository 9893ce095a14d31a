"""How the torch engine should apply a LoRA version: merged into the weights once per version (what
`rollout/install.py` does), or on the fly (peft's LoRA layers in the sampling model, the adapter's two
small matmuls on every token of every sample). One invocation, on the `mid` model of
bench/engine_bench.py (50M parameters) and on the demo's tiny model, LoRA r = 16 on every linear layer:

- merged: the installer's merge + load per version, then a batch sampled with plain weights (baseline);
- on the fly: the adapter's tensors copied into peft's layers per version, then the same batch.

Prints per model the per-version cost, the per-batch sampling time, their ratios against merged, and the
batches per version above which merging wins (it always does when on-the-fly sampling is slower and the
merge costs less than a batch). One JSON line at the end.

    .venv/bin/python bench/lora_apply_bench.py [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from engine_bench import models as bench_models

from sparkrl.services.common.settings import SamplingSettings, TorchEngineSettings
from sparkrl.services.common.weight_sync import weights_checksum
from sparkrl.services.rollout.install import LORA_A, LORA_B, VersionInstaller
from sparkrl.services.rollout.torch_engine import TorchEngine

RANK = 16
Versions = list[dict[str, torch.Tensor]]
SAMPLING = SamplingSettings(n=8, max_new_tokens=24, temperature=1.0, topk_logprobs=20)  # the demo's
PROMPTS = 8  # the demo's prompts per batch


def adapter_for(model: torch.nn.Module, seed: int) -> tuple[dict[str, torch.Tensor], str]:
    generator = torch.Generator().manual_seed(seed)
    layers = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head")
    adapter = {}
    for layer in layers:
        out_features, in_features = model.get_submodule(layer).weight.shape
        adapter[layer + LORA_A] = 0.01 * torch.randn(RANK, in_features, generator=generator)
        adapter[layer + LORA_B] = 0.01 * torch.randn(out_features, RANK, generator=generator)
    base = weights_checksum((layer, model.get_submodule(layer).weight.float()) for layer in layers)
    return adapter, base


def prompts(engine: TorchEngine) -> list[list[int]]:
    return [
        engine.tokenizer(f"Use {i} {i + 3} {2 * i} to make {4 * i}.\n")["input_ids"] for i in range(PROMPTS)
    ]


def timed(
    engine: TorchEngine, take: Callable[[int, dict[str, torch.Tensor]], None], versions: Versions
) -> dict[str, float]:
    """Per version: `take` it (timed), then sample one batch (timed); the medians. Closes the engine."""
    per_version, per_batch = [], []
    for version, adapter in enumerate(versions, start=1):
        started = time.perf_counter()
        take(version, adapter)
        per_version.append(time.perf_counter() - started)
        started = time.perf_counter()
        engine.generate(prompts(engine), SAMPLING)
        per_batch.append(time.perf_counter() - started)
    engine.close()
    return {"version_s": statistics.median(per_version), "batch_s": statistics.median(per_batch)}


def merged(model_dir: Path, threads: int, repeats: int) -> dict[str, float]:
    engine = TorchEngine(model_dir, TorchEngineSettings(dtype="float32", threads=threads))
    installer = VersionInstaller(engine, model_dir)
    _, base = adapter_for(engine.model, 0)  # the base's checksum, before any version is merged into it
    versions = [adapter_for(engine.model, version)[0] for version in range(1, repeats + 1)]
    return timed(engine, lambda version, adapter: installer.install(adapter, version, base), versions)


def on_the_fly(model_dir: Path, threads: int, repeats: int) -> dict[str, float]:
    from peft import LoraConfig, inject_adapter_in_model

    engine = TorchEngine(model_dir, TorchEngineSettings(dtype="float32", threads=threads))
    versions = [adapter_for(engine.model, version)[0] for version in range(1, repeats + 1)]  # before peft
    layers = sorted({name.removesuffix(LORA_A) for name in versions[0] if name.endswith(LORA_A)})
    config = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=[n.rsplit(".", 1)[-1] for n in layers])
    engine.model = inject_adapter_in_model(config, engine.model)  # alpha = r: B carries the scaling

    @torch.no_grad()
    def take(version: int, adapter: dict[str, torch.Tensor]) -> None:
        for layer in layers:
            module: Any = engine.model.get_submodule(layer)
            module.lora_A["default"].weight.copy_(adapter[layer + LORA_A])
            module.lora_B["default"].weight.copy_(adapter[layer + LORA_B])
        engine.policy_version = version

    return timed(engine, take, versions)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    models = bench_models(["tiny", "mid"])
    out: dict[str, Any] = {}
    batch = f"{PROMPTS} prompts x {SAMPLING.n} samples x {SAMPLING.max_new_tokens} tokens"
    print(
        f"LoRA r={RANK} on every linear layer; a batch: {batch}; {args.threads} thread(s), "
        f"median of {args.repeats}"
    )
    print(f"{'model':<6}{'way':<12}{'per version s':>15}{'x merged':>10}{'per batch s':>13}{'x merged':>10}")
    for name, model_dir in models.items():
        base = merged(model_dir, args.threads, args.repeats)
        fly = on_the_fly(model_dir, args.threads, args.repeats)
        extra = fly["batch_s"] - base["batch_s"]  # what on the fly costs a batch
        saved = base["version_s"] - fly["version_s"]  # what it saves a version
        even = saved / extra if extra > 0 else float("inf")
        out[name] = {"merged": base, "on_the_fly": fly, "break_even_batches_per_version": even}
        for way, row in (("merged", base), ("on the fly", fly)):
            print(
                f"{name:<6}{way:<12}{row['version_s']:>15.4f}{row['version_s'] / base['version_s']:>10.3f}"
                f"{row['batch_s']:>13.3f}{row['batch_s'] / base['batch_s']:>10.3f}"
            )
        print(f"{'':<6}merging wins from {even:.2f} batches per version on")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
