"""The one place a loss is chosen by name: `@register_loss` on each loss function names its settings class
and what it allows; everything else is derived from the two. The math never branches on the name; the
learner calls `policy_loss(inputs, cfg.loss)` once per micro-batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, get_args

from sparkrl.services.common.losses.section import LossSection

if TYPE_CHECKING:
    from torch import Tensor

    from sparkrl.services.common.losses.ops import Metrics


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's per-token tensors, each [B, T].

    `logp` (and `entropy`) carry gradient; the rest are treated as constants. The optional fields are
    `None` when the learner did not compute them: `proxy_logp` (Lp-Reg's min-p proxy of π_old, −inf where
    filtered), `entropy` (the current policy's per-token entropy), `token_weights` (each token's weight in
    the aggregation — `learner.loss_aggregation` — times its importance weight against the rollout
    engine, truncated or masked, mismatch.py; None: 1).
    """

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    mask: Tensor
    proxy_logp: Tensor | None = None
    entropy: Tensor | None = None
    token_weights: Tensor | None = None


REQUIRED = ("logp", "old_logp", "advantages", "mask")  # every loss's first four arguments
OPTIONAL = tuple(f.name for f in fields(LossInputs) if f.name not in REQUIRED)
PolicyLoss = Callable[..., "tuple[Tensor, Metrics]"]


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: its function and settings class, what it needs and what it allows."""

    name: str
    fn: PolicyLoss
    settings: type[LossSection]
    needs: tuple[str, ...]  # the optional LossInputs its signature names (`proxy_logp`, `entropy`, …)
    zero_advantage_free: bool  # a token mean of terms that vanish at A = 0 (`learner.skip_zero_advantage`)
    entropy_gradient: bool  # the gradient flows through the entropy (else it is a measurement only)
    own_aggregation: bool  # it averages by its own definition: learner.loss_aggregation token_mean only
    sequence_level: bool  # it averages over a row as one sequence: no packing, no shared prompts

    def __call__(self, inputs: LossInputs, cfg: LossSection) -> tuple[Tensor, Metrics]:
        extra = {}
        for field in self.needs:
            value = getattr(inputs, field)
            if value is None and field != "token_weights":
                raise ValueError(f"policy loss {self.name!r} needs LossInputs.{field}, which is None")
            extra[field] = value
        return self.fn(inputs.logp, inputs.old_logp, inputs.advantages, inputs.mask, cfg, **extra)


LOSSES: dict[str, LossSpec] = {}  # name → spec, in the order the loss modules registered


def register_loss(
    settings: type[LossSection],
    *,
    zero_advantage_free: bool = False,
    entropy_gradient: bool = False,
    own_aggregation: bool = False,
    sequence_level: bool = False,
) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register the decorated function under every name `settings.name` allows.

    The function is `fn(logp, old_logp, advantages, mask, cfg, *, <optional inputs it uses>)`, all tensors
    [B, T], `cfg` an instance of `settings`; it returns (loss, metrics). `zero_advantage_free`: each token's
    term vanishes where A = 0 and whatever it chooses it chooses among A ≠ 0 tokens, so completions with
    A = 0 need not run (the learner still counts their tokens in the mean). `entropy_gradient`: it needs
    the entropy with its gradient. `own_aggregation`: its mean is its own (over chosen tokens, over
    sequences), so `learner.loss_aggregation` must stay token_mean. `sequence_level`: it treats each row
    as one sequence (implies `own_aggregation`)."""

    def register(fn: PolicyLoss) -> PolicyLoss:
        names = get_args(settings.model_fields["name"].annotation)
        params = inspect.signature(fn).parameters
        assert list(params)[:5] == [*REQUIRED, "cfg"], (
            f"{fn.__name__}: (logp, old_logp, advantages, mask, cfg)"
        )
        needs = tuple(name for name in OPTIONAL if name in params)
        for name in names:
            if name in LOSSES:
                raise ValueError(
                    f"loss {name!r} is registered twice ({LOSSES[name].fn.__name__}, {fn.__name__})"
                )
            own = own_aggregation or sequence_level
            LOSSES[name] = LossSpec(
                name, fn, settings, needs, zero_advantage_free, entropy_gradient, own, sequence_level
            )
        return fn

    return register


def loss_spec(name: str) -> LossSpec:
    """The loss registered as `name`; KeyError naming the known ones."""
    try:
        return LOSSES[name]
    except KeyError:
        raise KeyError(f"unknown policy loss {name!r}; known: {', '.join(sorted(LOSSES))}") from None


def policy_loss(inputs: LossInputs, cfg: LossSection) -> tuple[Tensor, Metrics]:
    """The loss `cfg.name` on `inputs` with the hyperparameters of `cfg` (its settings)."""
    return loss_spec(cfg.name)(inputs, cfg)  # type: ignore[attr-defined]


def settings_classes() -> list[type[LossSection]]:
    """Every registered loss's settings class, once each, in registration order."""
    return list(dict.fromkeys(spec.settings for spec in LOSSES.values()))
