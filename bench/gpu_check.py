"""One short check of the GPU paths on a real device, printing ONE JSON line (`bench/gpu_check.sh` runs it).

    .venv/bin/python bench/gpu_check.py --model DIR [--device cuda|cpu] [--tokens N] [--vocab V]

Checks, each `{"status": "ok" | "skipped" | "failed", "reason": ..., figures}`:

- `env`: torch, CUDA, the GPU, NCCL in torch, nccl4py and vLLM present or not.
- `torch_engine`: the torch rollout engine generating on the device (tokens/s); its log-probs against a
  float32 recompute of the same model on the device.
- `learner_step`: two DeepSpeed ZeRO-2 steps on the tiny model (one GPU): finite loss, every parameter
  changed, seconds per step.
- `lp_reg`: the Lp-Reg loss and both proxies at V = 151,936 on the device (the learner's shapes): times,
  max |proxy from logits − proxy from top-k| where the top-k is exact, both against a float64 CPU
  reference on a slice; the loss against its float64 CPU value.
- `broadcast_<backend>`: learner (this process) → one receiver process, checksum verified, GB/s; gloo
  always, nccl / nccl4py where two GPUs exist (NCCL takes one GPU per rank).

`--device cpu` runs the same checks in a reduced form (fewer tokens, gloo only), so the script itself
is tested on machines without a GPU. Logs go to stderr; stdout carries only the JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

Check = dict[str, Any]
VOCAB = 151_936  # Qwen2's vocabulary: the proxies' real width
KAPPA = 0.02
TOPK = 64
REFERENCE_ROWS = 32  # rows of the float64 CPU reference


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int = 3) -> tuple[Any, float]:
    """fn's result and its best wall time of `repeats` (after one warm-up run), seconds."""
    result = fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        result = fn()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return result, best


def check_env(device: torch.device) -> Check:
    import torch.distributed as dist

    out: Check = {"status": "ok", "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    out["nccl_in_torch"] = dist.is_nccl_available()
    if torch.cuda.is_available():
        out |= {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count()}
        version = torch.cuda.nccl.version()
        out["nccl_version"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    try:
        import nccl.core as nccl

        out["nccl4py"] = str(nccl.get_version().nccl4py_version)
    except Exception as exc:  # not installed, or no CUDA driver for it: say which
        out["nccl4py"] = None
        out["nccl4py_reason"] = f"{type(exc).__name__}: {exc}"[:200]
    out["vllm"] = importlib.util.find_spec("vllm") is not None
    if device.type == "cuda" and not torch.cuda.is_available():
        return {**out, "status": "failed", "reason": "--device cuda and torch sees no CUDA device"}
    return out


def check_torch_engine(model_dir: Path, device: torch.device) -> Check:
    from sparkrl.services.common.settings import SamplingSettings, TorchEngineSettings
    from sparkrl.services.rollout.torch_engine import TorchEngine

    engine = TorchEngine(model_dir, TorchEngineSettings(device=str(device)))
    try:
        prompts = [
            engine.tokenizer(text)["input_ids"] for text in ("Use 3 7 to make 21.\n", "Use 8 2 to make 16.\n")
        ]
        sampling = SamplingSettings(n=8, max_new_tokens=24, topk_logprobs=8, seed=0)
        groups, seconds = _timed(lambda: engine.generate(prompts, sampling), device, repeats=2)
        tokens = sum(c.num_tokens for g in groups for c in g)
        completion = groups[0][0]
        model = engine.model
        ids = torch.tensor([prompts[0] + completion.token_ids.tolist()], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompts[0]) - 1 : -1].float()
        want = torch.log_softmax(logits, -1).gather(
            1, torch.as_tensor(completion.token_ids, device=device).long()[:, None]
        )
        diff = float((want.squeeze(1).cpu() - torch.from_numpy(completion.logprobs)).abs().max())
        finite = all(np.isfinite(c.logprobs).all() for g in groups for c in g)
        ok = finite and diff < 1e-3 and next(model.parameters()).device.type == device.type
        return {
            "status": "ok" if ok else "failed",
            "reason": None if ok else f"finite={finite}, logprob diff {diff:.2e}",
            "tokens": tokens,
            "seconds": round(seconds, 4),
            "tokens_per_s": round(tokens / seconds, 1),
            "logprob_max_abs_diff": diff,
        }
    finally:
        engine.close()


def check_learner_step(model_dir: Path, device: torch.device) -> Check:
    from sparkrl.proto.testing import random_group
    from sparkrl.services.common.modeling import load_model
    from sparkrl.services.common.settings import load_settings
    from sparkrl.services.learner.batch import micro_batches, samples_from_groups
    from sparkrl.services.learner.trainer import build_engine, init_distributed
    from sparkrl.services.learner.update import apply_update, old_policy

    overrides = [f"learner.device={device.type}", "learner.zero_stage=2", "learner.lr=1e-3"]
    cfg = load_settings("smoke", [*overrides, "learner.micro_batch_tokens=256"]).learner
    init_distributed(cfg)
    engine = build_engine(load_model(model_dir), cfg)
    before = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    rng = np.random.default_rng(0)
    seconds, losses = [], []
    for _ in range(2):
        groups = [
            random_group(rng, n=4, T=6, k=8, vocab_size=260).model_copy(
                update={"rewards": [1.0, 0.0, 1.0, 0.0]}
            )
            for _ in range(4)
        ]
        batches = [mb.to(engine.device) for mb in micro_batches(samples_from_groups(groups), 256, pad_id=0)]
        _sync(device)
        started = time.perf_counter()
        olds = [old_policy(engine.module, mb, cfg) for mb in batches]
        stats, _, _ = apply_update(engine, batches, olds, cfg)
        _sync(device)
        seconds.append(time.perf_counter() - started)
        losses.append(float(stats["loss"]))
    unchanged = [n for n, p in engine.module.named_parameters() if torch.equal(p, before[n])]
    ok = all(np.isfinite(losses)) and not unchanged and engine.device.type == device.type
    return {
        "status": "ok" if ok else "failed",
        "reason": None if ok else f"losses {losses}, unchanged {unchanged[:3]}, on {engine.device}",
        "zero_stage": 2,
        "engine_device": str(engine.device),
        "losses": losses,
        "step_seconds": [round(s, 4) for s in seconds],
    }


def _proxy_float64(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The proxy by its definition, float64 on CPU: p̃ = p·[p ≥ κ·max p] / Σ kept p, log p̃ of the token."""
    p = torch.softmax(logits.double().cpu(), dim=-1)  # [N, V]
    kept = p >= KAPPA * p.amax(dim=-1, keepdim=True)
    p_tok = p.gather(1, tokens.cpu()[:, None]).squeeze(1)
    kept_tok = kept.gather(1, tokens.cpu()[:, None]).squeeze(1)
    proxy = torch.log(p_tok / (p * kept).sum(-1))
    return torch.where(kept_tok, proxy, torch.full_like(proxy, float("-inf")))


def _max_abs(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor) -> float:
    """max |a − b| where `where` and both finite (filtered −inf must agree, checked apart)."""
    both = where & torch.isfinite(a) & torch.isfinite(b)
    return float((a.double() - b.double()).abs()[both].max()) if both.any() else 0.0


def _lm_like_logits(
    B: int, T: int, V: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [B, T, V], their log-softmax and the sampled tokens [B, T], on the generator's device."""
    device = generator.device
    # Three positions in four peaked as a trained LM's are (a few candidates far above a long tail: min-p
    # keeps a handful, the top-k is exact); the fourth flat, where min-p keeps more than the top-k (inexact).
    logits = torch.randn(B, T, V, generator=generator, device=device) * 2.0
    peaked = torch.arange(T, device=device) % 4 != 0  # [T]
    boost = 16.0 + 4.0 * torch.rand(B, T, 8, generator=generator, device=device)
    logits[..., :8] += boost * peaked[None, :, None]
    logp_all = torch.log_softmax(logits, dim=-1)
    sampled = torch.multinomial(logp_all.view(-1, V).exp(), 1, generator=generator).view(B, T)
    # At flat positions the sampled token is a kept one (the likeliest), low in log-prob but not noise:
    # the tokens Lp-Reg regularizes.
    token_ids = torch.where(peaked[None, :], sampled, logits.argmax(dim=-1))  # [B, T]
    return logits, logp_all, token_ids


def check_lp_reg(device: torch.device, tokens: int, vocab: int) -> Check:
    from sparkrl.services.common.losses.lp_reg import LpRegLoss, lp_reg_loss
    from sparkrl.services.learner.proxy import proxy_logp_from_logits, proxy_logp_from_topk

    generator = torch.Generator(device=device).manual_seed(0)
    B, T, V = 4, tokens // 4, vocab
    logits, logp_all, token_ids = _lm_like_logits(B, T, V, generator)
    topk_logp, topk_ids = logp_all.topk(TOPK, dim=-1)
    from_logits, t_logits = _timed(lambda: proxy_logp_from_logits(logits, token_ids, KAPPA), device)
    (from_topk, exact), t_topk = _timed(
        lambda: proxy_logp_from_topk(token_ids, topk_ids, topk_logp, KAPPA), device
    )
    agree_filtered = bool((torch.isneginf(from_logits) == torch.isneginf(from_topk))[exact].all())
    rows = slice(0, REFERENCE_ROWS)
    reference = _proxy_float64(logits.view(-1, V)[rows], token_ids.view(-1)[rows])
    finite_ref = torch.isfinite(reference)
    ref_vs_logits = _max_abs(from_logits.view(-1)[rows].cpu(), reference, finite_ref)
    ref_vs_topk = _max_abs(from_topk.view(-1)[rows].cpu(), reference, finite_ref & exact.view(-1)[rows].cpu())
    logits_vs_topk = _max_abs(from_logits, from_topk, exact)

    old_logp = logp_all.gather(-1, token_ids[..., None]).squeeze(-1)
    logp = (old_logp + 0.05 * torch.randn(B, T, generator=generator, device=device)).requires_grad_()
    adv = torch.where(torch.arange(B, device=device)[:, None] % 2 == 0, 1.0, -1.0).expand(B, T).contiguous()
    mask = torch.ones(B, T, dtype=torch.bool, device=device)

    # ρ = 1% selects k_neg = int(N_neg·ρ) > 1 tokens only from 200 negative tokens on: the reduced (CPU) form
    # raises ρ so the regularized branch runs there too.
    rho = max(0.01, 3.0 / (B * T / 2))

    def loss_and_grad() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp.grad = None
        loss, metrics = lp_reg_loss(logp, old_logp, adv, mask, LpRegLoss(rho=rho), proxy_logp=from_logits)
        loss.backward()
        return loss.detach(), metrics

    (loss, metrics), t_loss = _timed(loss_and_grad, device)
    logp64, old64, proxy64, adv64 = (x.detach().double().cpu() for x in (logp, old_logp, from_logits, adv))
    loss64, _ = lp_reg_loss(logp64, old64, adv64, mask.cpu(), LpRegLoss(rho=rho), proxy_logp=proxy64)
    loss_diff = abs(float(loss) - float(loss64))
    tolerances = {"ref_vs_logits": 1e-4, "ref_vs_topk": 1e-4, "logits_vs_topk": 1e-4, "loss": 1e-5}
    figures = {"ref_vs_logits": ref_vs_logits, "ref_vs_topk": ref_vs_topk, "logits_vs_topk": logits_vs_topk,
               "loss": loss_diff}  # fmt: skip
    bad = [name for name, value in figures.items() if not value <= tolerances[name]]
    ok = not bad and agree_filtered and bool(torch.isfinite(loss)) and int(metrics["reg_tokens"]) > 0
    return {
        "status": "ok" if ok else "failed",
        "reason": None if ok else f"over tolerance: {bad}, filtered agree {agree_filtered}",
        "shape": [B, T, V],
        "seconds_proxy_from_logits": round(t_logits, 5),
        "seconds_proxy_from_topk": round(t_topk, 5),
        "seconds_loss_fwd_bwd": round(t_loss, 5),
        "exact_frac": round(float(exact.float().mean()), 4),
        "max_abs_logits_vs_topk": logits_vs_topk,
        "max_abs_float64_vs_logits": ref_vs_logits,
        "max_abs_float64_vs_topk": ref_vs_topk,
        "loss": float(loss),
        "loss_abs_diff_float64": loss_diff,
        "rho": rho,
        "reg_tokens": int(metrics["reg_tokens"]),
    }


def _receiver_main(backend: str, device: int | None, announcement_json: str, results: Any) -> None:
    """A worker process: receive one announced version, report the checksum verdict."""
    from sparkrl.proto import WeightAnnouncement
    from sparkrl.services.common.weight_sync import SyncFailed, WeightReceiver

    if device is not None:
        torch.cuda.set_device(device)
    try:
        with WeightReceiver("gpu-check", backend=backend, timeout_s=60.0) as receiver:  # type: ignore[arg-type]
            receiver.receive(WeightAnnouncement.model_validate_json(announcement_json))
        results.put(("ok", ""))
    except (SyncFailed, RuntimeError) as exc:
        results.put(("failed", str(exc)[:300]))


def check_broadcast(backend: str, device: torch.device, megabytes: int) -> Check:
    from sparkrl.services.common.weight_sync import WeightSender

    gpus = torch.cuda.device_count()
    if backend != "gloo":
        if device.type != "cuda":
            return {"status": "skipped", "reason": f"{backend} needs CUDA (--device cpu)"}
        if gpus < 2:
            return {"status": "skipped", "reason": f"{backend} needs 2 GPUs: NCCL refuses two ranks of one "
                    f"communicator on the same GPU, this machine has {gpus}"}  # fmt: skip
        if backend == "nccl4py" and importlib.util.find_spec("nccl") is None:
            return {"status": "skipped", "reason": "nccl4py is not installed"}
    generator = torch.Generator().manual_seed(0)
    state = {
        f"layer{i}.weight": torch.randn(megabytes << 16, generator=generator) for i in range(4)
    }  # 4 × MB/4
    if device.type == "cuda":
        state = {name: t.to(device) for name, t in state.items()}  # the learner's weights live on its GPU
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with WeightSender(backend=backend, timeout_s=60.0, bucket_bytes=64 << 20) as sender:  # type: ignore[arg-type]
        announcement = sender.announce(state, version=1, epoch=1, members=["gpu-check"])
        child_device = 1 if backend != "gloo" else None
        child = ctx.Process(
            target=_receiver_main, args=(backend, child_device, announcement.model_dump_json(), results)
        )
        child.start()
        try:
            report = sender.broadcast(state, announcement)
            verdict, why = results.get(timeout=120)
        finally:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
    ok = verdict == "ok"
    return {
        "status": "ok" if ok else "failed",
        "reason": why or None,
        "bytes": report.bytes,
        "group_seconds": round(report.group_seconds, 4),
        "transfer_seconds": round(report.transfer_seconds, 4),
        "gbps": round(report.gbps, 3),
    }


def check_logprob_memory(device: torch.device, tokens: int, vocab: int) -> Check:
    """Peak CUDA memory per token of the learner's log-prob + entropy pass with its backward, the old
    full-logits path against the chunked one (bench/logprob_memory.py, each case in a fresh process)."""
    if device.type != "cuda":
        return {"status": "skipped", "reason": "CUDA peak memory; on a CPU run bench/logprob_memory.py"}
    from logprob_memory import run_case  # bench/, beside this script

    base = {"device": "cuda", "tokens": tokens, "layers": 2, "hidden": 256, "entropy_grad": False}
    if vocab != VOCAB:
        return {"status": "skipped", "reason": f"logprob_memory.py's model has V = {VOCAB}"}
    full, chunked = (run_case({**base, "path": path}) for path in ("full", "chunked"))
    return {
        "status": "ok",
        "tokens": tokens,
        "full_bytes_per_token": full["peak_bytes"] // tokens,
        "chunked_bytes_per_token": chunked["peak_bytes"] // tokens,
        "ratio": round(full["peak_bytes"] / max(chunked["peak_bytes"], 1), 2),
        "full_s": full["seconds"],
        "chunked_s": chunked["seconds"],
    }


def _run(name: str, checks: dict[str, Check], fn: Callable[[], Check]) -> None:
    started = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:  # one failed check must not hide the others' figures
        traceback.print_exc(file=sys.stderr)
        result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:500]}
    result["check_seconds"] = round(time.perf_counter() - started, 3)
    checks[name] = result
    print(f"[gpu-check] {name}: {result['status']} ({result['check_seconds']}s)", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[int]:
    """Everything written to fd 1 (DeepSpeed's prints, NCCL's logs) goes to stderr; yields the real
    stdout's descriptor, for the one JSON line."""
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    try:
        yield real
    finally:
        sys.stdout.flush()
        os.dup2(real, 1)
        os.close(real)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, required=True, help="The tiny model (sparkrl build-tiny-model)."
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--tokens", type=int, default=None, help="Lp-Reg tokens (default: 4096 cuda, 64 cpu)."
    )
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument(
        "--broadcast-mb", type=int, default=None, help="Synthetic weights (256 cuda, 16 cpu)."
    )
    args = parser.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    tokens = args.tokens or (4096 if device.type == "cuda" else 64)
    megabytes = args.broadcast_mb or (256 if device.type == "cuda" else 16)
    started = time.perf_counter()
    checks: dict[str, Check] = {}
    with _stdout_to_stderr() as real_stdout:
        _run("env", checks, lambda: check_env(device))
        if checks["env"]["status"] == "ok":
            if device.type == "cuda":
                torch.cuda.set_device(device)
            _run("torch_engine", checks, lambda: check_torch_engine(args.model, device))
            _run("learner_step", checks, lambda: check_learner_step(args.model, device))
            _run("lp_reg", checks, lambda: check_lp_reg(device, tokens, args.vocab))
            _run("logprob_memory", checks, lambda: check_logprob_memory(device, tokens, args.vocab))
            for backend in ("gloo", "nccl", "nccl4py"):
                _run(f"broadcast_{backend}", checks, lambda b=backend: check_broadcast(b, device, megabytes))
        line = {
            "device": args.device,
            "ok": all(c["status"] != "failed" for c in checks.values()),
            "seconds": round(time.perf_counter() - started, 2),
            "checks": checks,
        }
        os.write(real_stdout, (json.dumps(line, default=str) + "\n").encode())
    sys.exit(0 if line["ok"] else 1)


if __name__ == "__main__":
    main()
