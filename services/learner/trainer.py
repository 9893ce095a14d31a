"""The DeepSpeed side of the learner: build the engine, and one optimizer step over micro-batches.

The loss is chosen once by name from the registry (`policy_loss`); nothing here branches on it.
"""

from __future__ import annotations

import os
import socket
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
from torch import Tensor

from sparkrl.services.common.settings import LearnerSettings
from sparkrl.services.learner.advantages import truncated_is_weights
from sparkrl.services.learner.batch import MicroBatch
from sparkrl.services.learner.losses import LossInputs, policy_loss
from sparkrl.services.learner.proxy import proxy_logp_from_logits, proxy_logp_from_topk


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def init_distributed(cfg: LearnerSettings) -> None:
    """One learner process needs no launcher: fill the env DeepSpeed reads, then init (gloo on CPU)."""
    for name, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
    ):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", str(cfg.dist_port or free_port()))
    deepspeed.init_distributed(dist_backend="gloo" if cfg.device == "cpu" else "nccl")
    world_size = torch.distributed.get_world_size()
    if world_size != 1:
        # Each rank would read the trajectory stream as the same consumer and publish weights on its own.
        raise RuntimeError(
            f"the learner runs as one DeepSpeed rank for now (launched with {world_size}); "
            "start it without torchrun/deepspeed --num_gpus, or with one process"
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


def token_logp_and_entropy(model: torch.nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor, Tensor]:
    """Forward at the sampling temperature → (logp [B, L-1], entropy [B, L-1], logits [B, L-1, V])."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]  # [B, L-1, V]
    logits = logits.float() / mb.temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # [B, L-1, V]
    logp = logp_all.gather(-1, mb.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, L-1]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [B, L-1]
    return logp, entropy, logits


@dataclass(frozen=True)
class OldPolicy:
    """What the loss needs from π_old for one micro-batch, all [B, L-1]."""

    old_logp: Tensor
    proxy_logp: Tensor
    is_weights: Tensor | None
    proxy_inexact: int  # positions where the top-k proxy is only approximate


@torch.no_grad()
def old_policy(model: torch.nn.Module, mb: MicroBatch, cfg: LearnerSettings) -> OldPolicy:
    """old_logp and the Lp-Reg proxy, from the rollout's numbers or from a pass of the current weights
    (before this step's update, so they are π_old for the step)."""
    need_pass = cfg.old_logp_source == "recompute" or cfg.proxy_source == "logits"
    learner_logp, logits = (None, None)
    if need_pass:
        learner_logp, _, logits = token_logp_and_entropy(model, mb)
    targets = mb.input_ids[:, 1:]
    if cfg.proxy_source == "logits":
        proxy = proxy_logp_from_logits(logits, targets, kappa=cfg.proxy_kappa)  # logits already / temperature
        inexact = 0
    else:
        proxy, exact = proxy_logp_from_topk(targets, mb.topk_ids, mb.topk_logp, kappa=cfg.proxy_kappa)
        inexact = int((mb.mask & ~exact).sum())
    is_weights = None
    if cfg.old_logp_source == "recompute":
        old_logp = learner_logp
        if cfg.tis_cap is not None:
            is_weights = truncated_is_weights(learner_logp, mb.rollout_logp, mb.mask, cap=cfg.tis_cap)
    else:
        old_logp = mb.rollout_logp
    return OldPolicy(old_logp, proxy, is_weights, inexact)


def step_and_grad_norm(engine: deepspeed.DeepSpeedEngine) -> float:
    """Optimizer step; the pre-clip gradient norm. ZeRO's optimizers record it; without ZeRO, DeepSpeed
    clips the torch optimizer's gradients and drops the norm, so it is measured here first."""
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    norm = float(torch.nn.utils.get_total_norm(grads)) if grads else None
    engine.step()
    zero_norm = engine.get_global_grad_norm()
    return float(zero_norm) if zero_norm is not None else (norm if norm is not None else float("nan"))


def train_step(
    engine: deepspeed.DeepSpeedEngine, batches: list[MicroBatch], olds: list[OldPolicy], cfg: LearnerSettings
) -> dict[str, float]:
    """Forward/backward every micro-batch, then one optimizer step. The step's loss is the token-mean
    over all its tokens: each micro-batch's token-mean is weighted by its share of the tokens."""
    total_tokens = max(sum(mb.num_tokens for mb in batches), 1)
    hparams = cfg.loss.model_dump(exclude={"name"})
    sums: dict[str, float] = defaultdict(float)
    for index, (mb, old) in enumerate(zip(batches, olds, strict=True)):
        engine.set_gradient_accumulation_boundary(index == len(batches) - 1)
        logp, entropy, _ = token_logp_and_entropy(engine, mb)
        inputs = LossInputs(
            logp=logp,
            old_logp=old.old_logp,
            advantages=mb.advantages,
            mask=mb.mask,
            proxy_logp=old.proxy_logp,
            entropy=entropy,
            is_weights=old.is_weights,
        )
        loss, stats = policy_loss(cfg.loss.name, inputs, **hparams)
        share = mb.num_tokens / total_tokens
        engine.backward(loss * share, scale_wrt_gas=False)
        sums["loss"] += float(loss.detach()) * share
        sums["entropy"] += float((entropy.detach() * mb.mask).sum()) / total_tokens
        sums["proxy_inexact"] += old.proxy_inexact
        for key, value in stats.items():
            # Counts add up over micro-batches; rates are averaged by token share.
            additive = key in ("reg_tokens", "reg_tokens_pos")
            sums[key] += float(value) * (1.0 if additive else share)
    sums["grad_norm"] = step_and_grad_norm(engine)
    sums["tokens"] = float(total_tokens)
    return dict(sums)
