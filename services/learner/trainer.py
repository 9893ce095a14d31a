"""The DeepSpeed side of the learner: build the engine, and one optimizer step over micro-batches.

The loss is chosen once by name from the registry (`policy_loss`); nothing here branches on it.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
from torch import Tensor

from sparkrl.services.common.settings import LearnerSettings
from sparkrl.services.learner import logprobs
from sparkrl.services.learner.advantages import truncated_is_metrics, truncated_is_weights
from sparkrl.services.learner.aggregation import aggregation_weights, sequences
from sparkrl.services.learner.batch import MicroBatch
from sparkrl.services.learner.losses import LossInputs, entropy_has_gradient, policy_loss
from sparkrl.services.learner.proxy import proxy_logp_from_topk
from sparkrl.services.learner.reference import kl_to_reference


def init_distributed(cfg: LearnerSettings, sync_host: str = "127.0.0.1") -> None:
    """The learner's default process group (DeepSpeed's). Under a launcher (torchrun, `deepspeed`, or
    `sparkrl up` with `learner.ranks` > 1) it is the launcher's env:// rendezvous, as many ranks as it
    started; one learner process needs no launcher: a file rendezvous (so the default group opens no
    TCP listener at all). gloo's own connections stay on loopback when the learner is local."""
    if torch.distributed.is_initialized():
        return
    backend = "gloo" if cfg.device == "cpu" else "nccl"
    local = os.environ.get("MASTER_ADDR", sync_host) in ("127.0.0.1", "localhost", "::1")
    if sys.platform == "linux" and local and sync_host in ("127.0.0.1", "localhost", "::1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if os.environ.get("WORLD_SIZE", "1") != "1":
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
        return
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)  # what DeepSpeed's engine reads, as a launcher would set them
    store = Path(tempfile.mkdtemp(prefix="sparkrl-dist-")) / "store"
    deepspeed.init_distributed(
        dist_backend=backend,
        auto_mpi_discovery=False,  # one process: nothing to discover
        init_method=f"file://{store}",
        rank=0,
        world_size=1,
    )


def deepspeed_config(cfg: LearnerSettings) -> dict[str, Any]:
    """Micro-batch and accumulation are driven by hand (`set_gradient_accumulation_boundary`), since a
    step's number of micro-batches depends on its token count; the config just states 1 and 1."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def build_engine(model: torch.nn.Module, cfg: LearnerSettings) -> deepspeed.DeepSpeedEngine:
    """A torch AdamW passed in, so DeepSpeed does not JIT-compile its fused Adam (~45 s on CPU)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg))
    return engine


def token_logp_and_entropy(
    model: torch.nn.Module, mb: MicroBatch, entropy_grad: bool = True
) -> tuple[Tensor, Tensor]:
    """Forward at the sampling temperature → (logp [B, L-1], entropy [B, L-1]).

    Only the positions from the first generated-token target on go through the output projection, a chunk
    of positions at a time (logprobs.py: no [B, L-1, V] tensor is kept, nor the logits for the backward):
    the prompt's leading positions come back as zeros, masked out everywhere. `entropy_grad=False`: the
    entropy is a measurement only (no gradient kept for it).
    """
    return logprobs.token_logp_and_entropy(model, mb, entropy_grad)


@dataclass(frozen=True)
class OldPolicy:
    """What the loss needs from π_old for one micro-batch, all [B, L-1]."""

    old_logp: Tensor
    proxy_logp: Tensor
    is_weights: Tensor | None
    proxy_inexact: int  # positions where the top-k proxy is only approximate
    ref_logp: Tensor | None = None  # the frozen reference's log-probs (learner.kl), else None
    tis: dict[str, float] | None = None  # truncated IS: `capped_tokens`, `weight_mean` (with is_weights)


def autocast(cfg: LearnerSettings) -> torch.autocast:
    """The forward's precision: bf16 matmuls under `learner.autocast`, float32 otherwise."""
    device = "cpu" if cfg.device == "cpu" else "cuda"
    return torch.autocast(device, dtype=torch.bfloat16, enabled=_bf16_autocast(cfg.autocast, device))


@functools.cache
def _bf16_autocast(setting: str, device: str) -> bool:
    if setting != "auto":
        return setting == "bfloat16"
    if device == "cpu":  # without native bf16 (AVX512-BF16, AMX), autocast would only emulate it: slower
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


@torch.no_grad()
def old_policy(
    model: torch.nn.Module, mb: MicroBatch, cfg: LearnerSettings, reference: torch.nn.Module | None = None
) -> OldPolicy:
    """old_logp and the Lp-Reg proxy, from the rollout's numbers or from a pass of the current weights
    (before this step's update, so they are π_old for the step); with a `reference`, its log-probs."""
    need_pass = cfg.old_logp_source == "recompute" or cfg.proxy_source == "logits"
    learner_logp, proxy = (None, None)
    if need_pass:
        kappa = cfg.proxy_kappa if cfg.proxy_source == "logits" else None
        with autocast(cfg):  # one pass for both, a chunk of positions at a time (logprobs.py)
            learner_logp, proxy = logprobs.old_logp_and_proxy(model, mb, kappa)
    targets = mb.input_ids[:, 1:]
    if cfg.proxy_source == "logits":
        inexact = 0
    else:
        proxy, exact = proxy_logp_from_topk(targets, mb.topk_ids, mb.topk_logp, kappa=cfg.proxy_kappa)
        inexact = int((mb.mask & ~exact).sum())
    is_weights, tis = None, None
    if cfg.old_logp_source == "recompute":
        old_logp = learner_logp
        if cfg.tis_cap is not None:
            is_weights = truncated_is_weights(learner_logp, mb.rollout_logp, mb.mask, cap=cfg.tis_cap)
            measured = truncated_is_metrics(learner_logp, mb.rollout_logp, mb.mask, cap=cfg.tis_cap)
            tis = {
                "capped_tokens": float(measured["capped_tokens"]),
                "weight_mean": float(measured["weight_mean"]),
            }
    else:
        old_logp = mb.rollout_logp
    ref_logp = None
    if reference is not None:
        with autocast(cfg):
            ref_logp = logprobs.old_logp_and_proxy(reference, mb, kappa=None)[0]
    return OldPolicy(old_logp, proxy, is_weights, inexact, ref_logp, tis)


def optimizer_step(engine: deepspeed.DeepSpeedEngine) -> tuple[float, bool]:
    """The optimizer step, unless the gradient norm is not finite: (pre-clip norm, whether it was applied).

    ZeRO's optimizers and DeepSpeed's bf16 one measure the norm and drop such a step themselves (its
    gradients cleared, `engine.skipped_steps` counted, the same on every rank). The plain torch optimizer
    of ZeRO stage 0 in float32 would apply NaN, and DeepSpeed clips its gradients and drops the norm, so
    here it is measured first and a non-finite step is dropped by hand: the gradients of every rank are
    the all-reduced ones by now, so every rank decides alike."""
    if engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled():
        engine.step()
        norm = engine.get_global_grad_norm()
        return (float(norm) if norm is not None else float("nan")), engine.was_step_applied()
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
    if not math.isfinite(norm):
        engine.zero_grad()
        return norm, False
    engine.step()
    return norm, True


def micro_batch_loss(
    model: torch.nn.Module,
    mb: MicroBatch,
    old: OldPolicy,
    cfg: LearnerSettings,
    totals: tuple[int, int],
    norm_length: int | None = None,
    entropy_grad: bool = True,
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """One micro-batch's (loss, the loss's statistics, entropy [B, L-1]): the registry's policy loss on its
    tokens, re-weighted for `learner.loss_aggregation` against the update's `totals` (tokens, sequences),
    plus the KL term when a reference is loaded."""
    with autocast(cfg):
        logp, entropy = token_logp_and_entropy(model, mb, entropy_grad)
    weights = aggregation_weights(mb.mask, cfg.loss_aggregation, totals[0], totals[1], norm_length)
    if weights is not None:
        weights = weights.to(mb.mask.device)
        weights = weights if old.is_weights is None else weights * old.is_weights
    inputs = LossInputs(
        logp=logp,
        old_logp=old.old_logp,
        advantages=mb.advantages,
        mask=mb.mask,
        proxy_logp=old.proxy_logp,
        entropy=entropy,
        is_weights=old.is_weights if weights is None else weights,
    )
    loss, stats = policy_loss(cfg.loss.name, inputs, **cfg.loss.model_dump(exclude={"name"}))
    if old.ref_logp is not None and cfg.kl.coef > 0:
        kl = kl_to_reference(logp, old.ref_logp, cfg.kl.estimator)
        kl_mean = (kl * mb.mask).sum() / mb.mask.sum().clamp(min=1)
        loss = loss + cfg.kl.coef * kl_mean
        stats = {**stats, "kl_ref": kl_mean.detach()}
    return loss, stats, entropy


def train_step(
    engine: deepspeed.DeepSpeedEngine,
    batches: list[MicroBatch],
    olds: list[OldPolicy],
    cfg: LearnerSettings,
    timings: dict[str, float] | None = None,
    norm_length: int | None = None,
    totals: tuple[int, int] | None = None,
) -> dict[str, float]:
    """Forward/backward every micro-batch, then one optimizer step. The step's loss is the token-mean
    over all its tokens: each micro-batch's token-mean is weighted by its share of the tokens, its tokens
    re-weighted for `learner.loss_aggregation` (aggregation.py; `norm_length`: Dr. GRPO's constant).
    `timings` gets the seconds of `forward_backward` and `optimizer`. `totals`: the update's (tokens,
    sequences) when `batches` is this rank's share of it (a data-parallel learner, ranks.py): each
    rank's loss is then scaled by the DP size, which DeepSpeed's gradient averaging divides out again.
    `skipped` is 1 when the step was not applied: its loss or gradient norm was not finite."""
    started = time.perf_counter()
    tokens, total_sequences = totals or (
        sum(mb.num_tokens for mb in batches),
        sum(sequences(mb.mask) for mb in batches),
    )
    total_tokens = max(tokens, 1)
    dp_size = engine.dp_world_size
    sums: dict[str, float] = defaultdict(float)
    entropy_grad = entropy_has_gradient(cfg.loss.name)
    for index, (mb, old) in enumerate(zip(batches, olds, strict=True)):
        engine.set_gradient_accumulation_boundary(index == len(batches) - 1)
        if mb.num_tokens == 0:  # a rank's padding (ranks.py): the pass every rank runs, contributing 0
            with autocast(cfg):
                logp, _ = token_logp_and_entropy(engine, mb, entropy_grad)
            engine.backward(logp.sum() * 0.0, scale_wrt_gas=False)
            continue
        loss, stats, entropy = micro_batch_loss(
            engine, mb, old, cfg, (total_tokens, total_sequences), norm_length, entropy_grad
        )
        share = mb.num_tokens / total_tokens
        # A non-finite loss goes backward as NaN (a tensor op: no GPU sync here), so its gradient is
        # non-finite for certain, on every rank once reduced, and `optimizer_step` drops the step.
        scale = torch.where(torch.isfinite(loss.detach()), share * dp_size, float("nan"))
        engine.backward(loss * scale, scale_wrt_gas=False)
        sums["loss"] += float(loss.detach()) * share
        sums["entropy"] += float((entropy.detach() * mb.mask).sum()) / total_tokens
        sums["proxy_inexact"] += old.proxy_inexact
        if old.tis is not None:  # how much truncated IS corrected the rollout engine's numbers
            sums["tis_capped_tokens"] += old.tis["capped_tokens"]
            sums["tis_weight_mean"] += old.tis["weight_mean"] * share
        for key, value in stats.items():
            if key == "entropy":
                continue  # measured above over every token; entropy_bonus reports its own copy
            # Counts add up over micro-batches; rates are averaged by token share.
            additive = key in ("reg_tokens", "reg_tokens_pos")
            sums[key] += float(value) * (1.0 if additive else share)
    stepped = time.perf_counter()
    sums["grad_norm"], applied = optimizer_step(engine)
    sums["skipped"] = 0.0 if applied else 1.0
    sums["tokens"] = float(total_tokens)
    if timings is not None:
        timings["forward_backward"] = stepped - started
        timings["optimizer"] = time.perf_counter() - stepped
    return dict(sums)
