"""The policy losses' settings: one section per loss, discriminated by `name` (`learner.loss.name`).

Split from `settings.py` only to keep files short; `settings.py` re-exports every name here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from sparkrl.services.common.settings_section import Section


class LpRegLoss(Section):
    """Lp-Reg (arXiv 2510.03222): PPO-clip plus a pull toward the min-p proxy on the lowest-prob tokens."""

    name: Literal["lp_reg"] = "lp_reg"
    rho: float = Field(0.01, ge=0, le=1, description="Fraction of A<0 tokens considered (lowest logp first).")
    rho_pos: float = Field(0.0, ge=0, le=1, description="The same for A>0 tokens (0: off).")
    beta: float = Field(1.0, ge=0, description="Weight of the kl3 pull toward the proxy.")
    clip_low: float = Field(1.0, ge=0, le=1, description="ε_low: ratio clipped below at 1 − ε_low.")
    clip_high: float = Field(9.0, ge=0, description="ε_high: ratio clipped above at 1 + ε_high.")


class PpoClipLoss(Section):
    """PPO/GRPO clipped surrogate."""

    name: Literal["ppo_clip", "grpo"] = "ppo_clip"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.")
    clip_high: float = Field(0.2, ge=0, description="ε_high.")


class ClipHigherLoss(Section):
    """DAPO's Clip-Higher: asymmetric clip."""

    name: Literal["clip_higher"] = "clip_higher"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.")
    clip_high: float = Field(0.28, ge=0, description="ε_high.")


class EntropyBonusLoss(Section):
    """GRPO + entropy loss."""

    name: Literal["entropy_bonus"] = "entropy_bonus"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.")
    clip_high: float = Field(0.2, ge=0, description="ε_high.")
    entropy_coef: float = Field(0.001, ge=0, description="Weight of −entropy in the loss.")


class EightyTwentyLoss(Section):
    """80/20: only the highest-entropy tokens get policy gradient."""

    name: Literal["eighty_twenty"] = "eighty_twenty"
    top_frac: float = Field(
        0.2, gt=0, le=1, description="Fraction of valid tokens (highest entropy) trained."
    )
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.")
    clip_high: float = Field(0.28, ge=0, description="ε_high.")


class KlCovLoss(Section):
    """KL-Cov: a KL penalty on the tokens of highest covariance between logp and advantage."""

    name: Literal["kl_cov"] = "kl_cov"
    kl_cov_ratio: float = Field(2e-4, ge=0, le=1, description="Fraction of tokens penalized.")
    ppo_kl_coef: float = Field(1.0, ge=0, description="Weight of |logp − old_logp| on them.")


class ClipCovLoss(Section):
    """Clip-Cov: detach a random few tokens whose covariance lies in [lb, ub]."""

    name: Literal["clip_cov"] = "clip_cov"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.")
    clip_high: float = Field(0.2, ge=0, description="ε_high.")
    clip_cov_ratio: float = Field(2e-4, ge=0, le=1, description="Fraction of tokens detached.")
    clip_cov_lb: float = Field(1.0, description="Lower covariance bound.")
    clip_cov_ub: float = Field(5.0, description="Upper covariance bound.")


class GspoLoss(Section):
    """GSPO: sequence-level importance ratio."""

    name: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0, le=1, description="ε_low on the sequence ratio.")
    clip_high: float = Field(4e-4, ge=0, description="ε_high on the sequence ratio.")


LossSettings = Annotated[
    LpRegLoss
    | PpoClipLoss
    | ClipHigherLoss
    | EntropyBonusLoss
    | EightyTwentyLoss
    | KlCovLoss
    | ClipCovLoss
    | GspoLoss,
    Field(discriminator="name"),
]
