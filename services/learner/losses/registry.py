"""The one place a loss is chosen by name. The math never branches on the name; the learner calls
`policy_loss(config.loss, inputs, **config.loss_hparams)` once per micro-batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor

from sparkrl.services.learner.losses.baselines import (
    clip_cov_loss,
    clip_higher_loss,
    eighty_twenty_loss,
    entropy_bonus_loss,
    gspo_loss,
    kl_cov_loss,
    ppo_clip_loss,
)
from sparkrl.services.learner.losses.common import Metrics
from sparkrl.services.learner.losses.lp_reg import lp_reg_loss


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's per-token tensors, each [B, T].

    `logp` (and `entropy`) carry gradient; the rest are treated as constants. The optional fields are
    `None` when the learner did not compute them: `proxy_logp` (Lp-Reg's min-p proxy of π_old, −inf where
    filtered), `entropy` (current policy's per-token entropy), `is_weights` (truncated-IS weights).
    """

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    mask: Tensor
    proxy_logp: Tensor | None = None
    entropy: Tensor | None = None
    is_weights: Tensor | None = None


PolicyLoss = Callable[..., tuple[Tensor, Metrics]]
_OPTIONAL_INPUTS = tuple(f.name for f in fields(LossInputs) if f.default is None and f.name != "is_weights")


def _call_with_inputs(
    fn: PolicyLoss, needs: tuple[str, ...], name: str, inputs: LossInputs, **hparams: Any
) -> tuple[Tensor, Metrics]:
    """Call `fn` with the always-present tensors, the optional ones it `needs`, and `hparams`."""
    extra: dict[str, Tensor] = {}
    for field in needs:
        value = getattr(inputs, field)
        if value is None:
            raise ValueError(f"policy loss {name!r} needs LossInputs.{field}, which is None")
        extra[field] = value
    return fn(
        logp=inputs.logp,
        old_logp=inputs.old_logp,
        advantages=inputs.advantages,
        mask=inputs.mask,
        is_weights=inputs.is_weights,
        **extra,
        **hparams,
    )


def _entry(name: str, fn: PolicyLoss, *needs: str) -> tuple[str, PolicyLoss]:
    assert set(needs) <= set(_OPTIONAL_INPUTS), needs
    return name, functools.partial(_call_with_inputs, fn, needs, name)


# name → callable(inputs: LossInputs, **hparams) -> (loss, metrics). Hyperparameter defaults live on the
# loss functions themselves; an unknown hparam fails loudly with the function's TypeError.
POLICY_LOSSES: dict[str, PolicyLoss] = dict(
    [
        _entry("ppo_clip", ppo_clip_loss),
        _entry("grpo", ppo_clip_loss),
        _entry("clip_higher", clip_higher_loss),
        _entry("entropy_bonus", entropy_bonus_loss, "entropy"),
        _entry("eighty_twenty", eighty_twenty_loss, "entropy"),
        _entry("kl_cov", kl_cov_loss),
        _entry("clip_cov", clip_cov_loss),
        _entry("gspo", gspo_loss),
        _entry("lp_reg", lp_reg_loss, "proxy_logp"),
    ]
)


# Losses whose gradient flows through the entropy; for the others it is a measurement only.
ENTROPY_GRADIENT: frozenset[str] = frozenset({"entropy_bonus"})


def entropy_has_gradient(name: str) -> bool:
    """Whether loss `name` needs the entropy with its gradient (else it is computed without one)."""
    return name in ENTROPY_GRADIENT


# Losses that are a token mean of per-token terms that vanish where A = 0, choosing whatever they choose
# (Lp-Reg's k lowest) among A ≠ 0 tokens only: a completion with A = 0 adds nothing to their gradient but
# its tokens to the mean's divisor, so the learner need not run it (`learner.skip_zero_advantage`). Not
# the others: the entropy bonus has a term on every token, 80/20 picks among every token by entropy,
# KL-Cov and Clip-Cov center their covariance on every token's mean, GSPO averages over the micro-batch's
# sequences.
SKIPS_ZERO_ADVANTAGE: frozenset[str] = frozenset({"ppo_clip", "grpo", "clip_higher", "lp_reg"})


def skips_zero_advantage(name: str) -> bool:
    """Whether loss `name`'s gradient is unchanged when completions with A = 0 are not run (see above)."""
    return name in SKIPS_ZERO_ADVANTAGE


def policy_loss(name: str, inputs: LossInputs, **hparams: Any) -> tuple[Tensor, Metrics]:
    """Compute the policy loss registered as `name` on `inputs`; `hparams` override its defaults."""
    try:
        loss_fn = POLICY_LOSSES[name]
    except KeyError:
        raise KeyError(f"unknown policy loss {name!r}; known: {', '.join(sorted(POLICY_LOSSES))}") from None
    return loss_fn(inputs, **hparams)
