"""The torch engine against vLLM's CPU build, on the same prompts and sampling, on three models.

usage: python bench/engine_bench.py [--vllm-python .venv-vllm/bin/python] [--threads 1] [--rounds 3]
                                    [--models tiny,long,mid]

Models (built here, nothing downloaded): `tiny` (the demo's 2-layer countdown model), `long`
(`bench/long_model.py`'s 3.3M-parameter Qwen2) and `mid` (a 50M-parameter Qwen2 of the same tokenizer,
randomly initialised: `.cache/mid-countdown`). Each engine runs in its own process: torch in this
interpreter, vLLM in `--vllm-python` (its environment, `make vllm-env`), both with `--threads` threads.

Per engine and model: start-up (engine built and ready), then `--rounds` timed generations of 16
countdown prompts × n=8 (≤ 64 new tokens, T=1, top-20 log-probs, seeded) after one untimed warm-up,
then `--rounds` timed weight updates (`load_weights` of the whole model, perturbed: for vLLM its
layerwise reload, hashing and verification). Printed: a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
MARK = "ENGINE_BENCH "
PROMPTS, N, MAX_NEW, TOPK = 16, 8, 64, 20
MID_SHAPE = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,  # head size 64: one vLLM's CPU attention runs
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
}


def ensure_mid_model(cache: Path, seed: int = 0) -> Path:
    """`cache/mid-countdown`: 50M parameters, built once (seeded) unless a build of this shape is there."""
    from sparkrl.services.common.tiny_model import build_model, build_tokenizer

    out = cache / "mid-countdown"
    stamp = {"shape": MID_SHAPE, "seed": seed}
    info = out / "build_info.json"
    if info.is_file() and json.loads(info.read_text()) == stamp:
        return out
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed, MID_SHAPE)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    info.write_text(json.dumps(stamp))
    return out


def models(names: list[str]) -> dict[str, Path]:
    from long_model import ensure_long_model

    from sparkrl.services.common.tiny_model import ensure_tiny_model

    cache = ROOT / ".cache"
    build = {"tiny": ensure_tiny_model, "long": ensure_long_model, "mid": ensure_mid_model}
    return {name: build[name](cache) for name in names}


# ── one engine on one model, in its own process ───────────────────────────────────────────────────────


def measure(engine_kind: str, model: Path, threads: int, rounds: int) -> dict[str, Any]:
    import torch

    from sparkrl.services.common.modeling import load_model
    from sparkrl.services.common.settings import SamplingSettings, TorchEngineSettings, VllmEngineSettings
    from sparkrl.services.common.tasks.countdown import format_prompt, generate_problem
    from sparkrl.services.rollout.engines import make_engine

    torch.set_num_threads(threads)
    settings: Any = (
        TorchEngineSettings(threads=threads, max_batch_sequences=PROMPTS * N)
        if engine_kind == "torch"
        else VllmEngineSettings(device="cpu", dtype="float32", threads=threads)
    )
    started = time.perf_counter()
    engine = make_engine(model, settings)
    startup = time.perf_counter() - started
    rng = random.Random(0)
    prompts = [engine.tokenizer(format_prompt(generate_problem(rng)))["input_ids"] for _ in range(PROMPTS)]
    sampling = SamplingSettings(n=N, max_new_tokens=MAX_NEW, topk_logprobs=TOPK, seed=1)
    engine.generate(prompts[:2], sampling)  # warm-up: first-call costs stay out of the rounds
    seconds, tokens = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        groups = engine.generate(prompts, sampling)
        seconds.append(time.perf_counter() - t0)
        tokens.append(sum(c.num_tokens for g in groups for c in g))
    state = load_model(model).state_dict()
    updates = []
    for round_ in range(rounds):
        generator = torch.Generator().manual_seed(round_)
        moved = {n: t + 1e-3 * torch.randn(t.shape, generator=generator) for n, t in state.items()}
        t0 = time.perf_counter()
        engine.load_weights(moved.items(), round_ + 1)
        updates.append(time.perf_counter() - t0)
    engine.close()
    gen_s = statistics.median(seconds)
    return {
        "params_m": sum(t.numel() for t in state.values()) / 1e6,
        "startup_s": startup,
        "completions_per_s": PROMPTS * N / gen_s,
        "tokens_per_s": statistics.median(tokens) / gen_s,
        "generate_s": gen_s,
        "update_s": statistics.median(updates),
    }


# ── the comparison ────────────────────────────────────────────────────────────────────────────────────


def run_child(python: str, engine: str, model: Path, threads: int, rounds: int) -> dict[str, Any]:
    command = [python, __file__, "--child", engine, "--model", str(model), "--threads", str(threads)]
    command += ["--rounds", str(rounds)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKRL_")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    raise SystemExit(f"{engine} on {model.name} failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="tiny,long,mid")
    parser.add_argument("--child", choices=["torch", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = measure(args.child, args.model, args.threads, args.rounds)
        print(MARK + json.dumps(result), flush=True)
        return
    results: dict[str, dict[str, Any]] = {}
    for name, path in models(args.models.split(",")).items():
        torch_run = run_child(sys.executable, "torch", path, args.threads, args.rounds)
        vllm_run = run_child(args.vllm_python, "vllm", path, args.threads, args.rounds)
        results[name] = {
            "params_m": round(torch_run.pop("params_m"), 2),
            "torch": torch_run,
            "vllm": vllm_run,
        }
        vllm_run.pop("params_m")
        ratio = vllm_run["tokens_per_s"] / torch_run["tokens_per_s"]
        results[name]["vllm_over_torch_tokens_per_s"] = ratio
        print(f"{name:5s} {results[name]['params_m']:6.1f}M params | threads {args.threads}")
        for kind, run in (("torch", torch_run), ("vllm", vllm_run)):
            speed = f"{run['completions_per_s']:7.1f} completions/s  {run['tokens_per_s']:8.0f} tokens/s"
            print(
                f"  {kind:5s} start {run['startup_s']:6.1f}s  {speed}  update {run['update_s'] * 1e3:7.1f} ms"
            )
        print(f"  vLLM / torch tokens/s: {ratio:.2f}", flush=True)
    line = {"bench": "engine", "threads": args.threads, "prompts": PROMPTS, "n": N, "max_new_tokens": MAX_NEW}
    print(json.dumps(line | {"models": results}, default=lambda v: round(v, 4)))


if __name__ == "__main__":
    main()
