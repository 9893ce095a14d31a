"""Per-token log-probs, entropy and Lp-Reg's logits proxy without a full-vocabulary tensor per micro-batch.

The model runs once through its own forward (a DeepSpeed engine's included), asked for the logits of one
position only (`logits_to_keep=1`); a forward hook on its decoder keeps the final hidden states [B, L, H]
(after the final norm) on the way. The output projection, the division by the temperature and everything
over the vocabulary then run `chunk` rows at a time, over the positions that predict a generated token
only (not the prompts, not the padding, not a packed row's later prompts): the full-vocabulary
temporaries are a few float32 [chunk, V] buffers, whatever B·L is (`chunk_tokens`: ≈ 256 MiB each).
Under grad each chunk is checkpointed, so the backward recomputes its logits instead of keeping them.

A model whose logits are more than `get_output_embeddings()(last_hidden_state)` (softcapping, logit
scales; `POST_HEAD_FIELDS`), or that lacks the accessors or `logits_to_keep`, takes
`full_logits_reference`: the whole [B, L-1, V] at once, as the learner always did. So does ZeRO-3 across
several ranks (each call of the projection would be a gather, and the ranks' numbers of chunks differ).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from sparkrl.services.learner.batch import MicroBatch
from sparkrl.services.learner.proxy import proxy_logp_from_logits

CHUNK_BYTES = 256 * 2**20  # one float32 [chunk, V] buffer

# transformers config fields that change the logits after the output projection (Gemma's softcap,
# Cohere's and Granite's scales, Falcon-H1's multiplier, a padded vocabulary cut back) or scale what it is
# fed (MiniCPM3): with any of them set, only the model's own forward gives its logits.
POST_HEAD_FIELDS = (
    "final_logit_softcapping",
    "logits_soft_cap",
    "logit_scale",
    "logits_scaling",
    "lm_head_multiplier",
    "unpadded_vocab_size",
)


def chunk_tokens(vocab_size: int) -> int:
    """Rows per chunk: one float32 [chunk, V] buffer of about `CHUNK_BYTES`, at least 1."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


def supports_chunking(model: torch.nn.Module) -> bool:
    """Whether `model` (or the module a DeepSpeed engine wraps) computes its logits as its output
    embedding applied to its decoder's output, and nothing more."""
    module = getattr(model, "module", model)
    get_head, get_decoder = (
        getattr(module, "get_output_embeddings", None),
        getattr(module, "get_decoder", None),
    )
    if not (callable(get_head) and callable(get_decoder) and _keeps_logits(module)):
        return False
    head, decoder = get_head(), get_decoder()
    if head is None or head is not getattr(module, "lm_head", None) or decoder in (None, module):
        return False  # a BERT-style `cls` block or an extra transform around the projection
    partitioned = [p for p in head.parameters() if hasattr(p, "ds_id")]  # ZeRO-3
    if partitioned and dist.is_initialized() and dist.get_world_size() > 1:
        # ZeRO-3 across ranks: every call of the projection gathers its weight, a collective, and the
        # ranks' micro-batches (so their numbers of chunks) differ: one call per micro-batch instead.
        return False
    if any(not p.requires_grad for p in partitioned):
        # A frozen output layer (LoRA) under ZeRO-3: gathered for the forward, but not again when the
        # backward recomputes a checkpointed chunk (it sees the empty partition): one call instead.
        return False
    config = getattr(module, "config", None)
    configs = [config, config.get_text_config()] if hasattr(config, "get_text_config") else [config]
    return not any(getattr(c, name, None) is not None for c in configs for name in POST_HEAD_FIELDS)


@dataclass(frozen=True)
class FinalHidden:
    """The decoder's output at the positions that predict a generated token (`mask`), flattened to rows."""

    states: Tensor  # [N, H], N = mask.sum(); the rows in the order of mask.nonzero()
    targets: Tensor  # [N] long: the token each row predicts
    temperature: Tensor  # [N, 1]
    head: torch.nn.Module  # the output embedding
    model_logits: Tensor  # [B, 1, V]: the model's own output (see `_AfterModelOutput`)
    mask: Tensor  # [B, L-1] bool: where the rows go back to

    def chunks(self, chunk: int | None) -> Iterator[slice]:
        size = chunk or chunk_tokens(self.model_logits.shape[-1])
        return (slice(start, start + size) for start in range(0, len(self.targets), size))

    def to_positions(self, rows: list[Tensor]) -> Tensor:
        """Per-row values [N] (in chunks) → [B, L-1], zeros where `mask` is False."""
        values = torch.cat(rows) if rows else self.states.new_zeros(0, dtype=torch.float32)
        return values.new_zeros(self.mask.shape).masked_scatter(self.mask, values)


def final_hidden(model: torch.nn.Module, mb: MicroBatch) -> FinalHidden:
    """One forward of `model` for its final hidden states; only the last position's logits are computed.

    A DeepSpeed engine is called itself, never around it through `.module`: its forward, and the hooks it
    puts on that forward's outputs, start ZeRO's backward bookkeeping (bypassed, ZeRO-3's gradients of the
    output projection come out wrong; tests/test_logprobs.py)."""
    module = getattr(model, "module", model)
    captured: list[Tensor] = []

    def keep(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        hidden = getattr(output, "last_hidden_state", None)
        captured.append(output[0] if hidden is None else hidden)

    handle = module.get_decoder().register_forward_hook(keep)
    try:
        out = model(**mb.model_inputs(), logits_to_keep=1, use_cache=False)
    finally:
        handle.remove()
    B, L = mb.input_ids.shape
    return FinalHidden(
        states=captured[-1][:, :-1][mb.mask],  # [N, H]
        targets=mb.input_ids[:, 1:][mb.mask],
        temperature=mb.temperature.expand(B, L - 1, 1)[mb.mask],
        head=module.get_output_embeddings(),
        model_logits=out.logits,
        mask=mb.mask,
    )


@torch.no_grad()
def entropy_sum(model: torch.nn.Module, micro: list[MicroBatch]) -> float:
    """The entropy of `model`'s distribution summed over the generated-token targets of `micro`, without
    gradient: a measurement (the entropy of completions an update does not run, update.py)."""
    total = 0.0
    for mb in micro:
        _, entropy = token_logp_and_entropy(model, mb, entropy_grad=False)
        total += float((entropy * mb.mask).sum())
    return total


def token_logp_and_entropy(
    model: torch.nn.Module, mb: MicroBatch, entropy_grad: bool = True, *, chunk: int | None = None
) -> tuple[Tensor, Tensor]:
    """Forward at the sampling temperature → (logp [B, L-1], entropy [B, L-1]), meaningful at the
    generated-token targets (`mb.mask`) only: zeros elsewhere. `entropy_grad=False`: the entropy is a
    measurement only (no gradient kept for it). `chunk`: rows per chunk (default `chunk_tokens(V)`)."""
    if not supports_chunking(model):
        logp, entropy, _ = full_logits_reference(model, mb, entropy_grad)
        return logp, entropy
    hidden = final_hidden(model, mb)
    grad = torch.is_grad_enabled()
    # Under grad each chunk is checkpointed: the backward recomputes its [chunk, V] logits, none is kept.
    forward = partial(checkpoint, _chunk_logp_entropy, use_reentrant=False) if grad else _chunk_logp_entropy
    logp_rows, entropy_rows = [], []
    for rows in hidden.chunks(chunk):
        inputs = (hidden.states[rows], hidden.targets[rows], hidden.temperature[rows])
        logp, entropy = forward(hidden.head, *inputs, entropy_grad)
        logp_rows.append(logp)
        entropy_rows.append(entropy)
    logp, entropy = hidden.to_positions(logp_rows), hidden.to_positions(entropy_rows)
    if grad:
        logp = _AfterModelOutput.apply(logp, hidden.model_logits)
        if entropy.requires_grad:
            entropy = _AfterModelOutput.apply(entropy, hidden.model_logits)
    return logp, entropy


@torch.no_grad()
def old_logp_and_proxy(
    model: torch.nn.Module, mb: MicroBatch, kappa: float | None, *, chunk: int | None = None
) -> tuple[Tensor, Tensor | None]:
    """π_old's logp [B, L-1] and, with `kappa`, the Lp-Reg proxy log-prob [B, L-1] from its logits
    (`proxy_logp_from_logits`: min-p at the sampling temperature), both from one pass; meaningful at the
    targets (`mb.mask`) only. The log-probs are computed as `token_logp_and_entropy` does, chunk for
    chunk, so an on-policy ratio is exactly 1."""
    if not supports_chunking(model):
        logp, _, logits = full_logits_reference(model, mb, entropy_grad=False)
        proxy = None if kappa is None else proxy_logp_from_logits(logits, mb.input_ids[:, 1:], kappa=kappa)
        return logp, proxy
    hidden = final_hidden(model, mb)
    logp_rows, proxy_rows = [], []
    for rows in hidden.chunks(chunk):
        x = _scaled_logits(hidden.head, hidden.states[rows], hidden.temperature[rows])  # [n, V]
        logp_rows.append(_token_logp(torch.log_softmax(x, dim=-1), hidden.targets[rows]))
        if kappa is not None:  # the logits are already at the temperature
            proxy_rows.append(proxy_logp_from_logits(x[None], hidden.targets[rows][None], kappa=kappa)[0])
    proxy = hidden.to_positions(proxy_rows) if kappa is not None else None
    return hidden.to_positions(logp_rows), proxy


def full_logits_reference(
    model: torch.nn.Module, mb: MicroBatch, entropy_grad: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """The whole-vocabulary pass → (logp [B, L-1], entropy [B, L-1], logits [B, L-1, V] / temperature).

    Only the positions from the first target on go through the output projection (`logits_to_keep`, where
    the model has one); the rest come back as zeros. The fallback for models `supports_chunking` refuses,
    and the reference the chunked pass is tested against.
    """
    first = _first_target(mb) if _keeps_logits(model) else 0
    extra = {"logits_to_keep": mb.input_ids.shape[1] - first} if first else {}
    logits = model(**mb.model_inputs(), **extra).logits[:, :-1]
    logits = logits.float() / mb.temperature  # [B, L-1-first, V]
    logp, entropy = _logp_entropy(logits, mb.input_ids[:, first + 1 :], entropy_grad)
    if first:
        logp, entropy = F.pad(logp, (first, 0)), F.pad(entropy, (first, 0))
        logits = F.pad(logits, (0, 0, first, 0))
    return logp, entropy, logits


def _scaled_logits(head: torch.nn.Module, states: Tensor, temperature: Tensor) -> Tensor:
    return head(states).float() / temperature  # [n, V] float32, whatever dtype the matmul ran in


def _chunk_logp_entropy(
    head: torch.nn.Module, states: Tensor, targets: Tensor, temperature: Tensor, entropy_grad: bool
) -> tuple[Tensor, Tensor]:
    return _logp_entropy(_scaled_logits(head, states, temperature), targets, entropy_grad)


def _logp_entropy(logits: Tensor, targets: Tensor, entropy_grad: bool) -> tuple[Tensor, Tensor]:
    """logits [..., V] (already / temperature), targets [...] → (logp [...], entropy [...])."""
    logp_all = torch.log_softmax(logits, dim=-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return _token_logp(logp_all, targets), entropy


def _token_logp(logp_all: Tensor, targets: Tensor) -> Tensor:
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


class _AfterModelOutput(torch.autograd.Function):
    """Identity on `values`, and a zero gradient for the model's own logits output in the backward.

    A DeepSpeed engine starts its backward bookkeeping (ZeRO's accumulation boundary, hook counts) from
    hooks on its forward's outputs. The chunked logits are computed outside that forward, so without this
    the output projection's gradient would be accumulated before those hooks ran, or they would never run.
    Tying the result to the model's [B, 1, V] logits makes the projection's gradient wait for them.
    """

    @staticmethod
    def forward(ctx: Any, values: Tensor, model_logits: Tensor) -> Tensor:
        ctx.logits_meta = (model_logits.shape, model_logits.dtype, model_logits.device)
        return values.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        shape, dtype, device = ctx.logits_meta
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _first_target(mb: MicroBatch) -> int:
    """The first position (column of [B, L-1]) where any row predicts a generated token."""
    columns = mb.mask.any(dim=0).nonzero()
    return int(columns[0]) if len(columns) else 0


def _keeps_logits(model: torch.nn.Module) -> bool:
    module = getattr(model, "module", model)  # a DeepSpeed engine forwards to its module
    return "logits_to_keep" in inspect.signature(module.forward).parameters
