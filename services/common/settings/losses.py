"""The policy losses' settings: one section per loss, discriminated by `name` (`learner.loss.name`).

Split from `settings.py` only to keep files short; `settings.py` re-exports every name here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from sparkrl.services.common.settings.section import Section

# Why each bound is where it is: `hparams.py` puts the reason into the 422 a live change out of bounds gets
# (`json_schema_extra["why"]`, keyed by the constraint). Shared by every loss that has the parameter.
FRACTION = {"why": {"ge": "it is a fraction of the tokens", "le": "it is a fraction of the tokens"}}
CLIP_LOW = {
    "why": {
        "ge": "a negative ε_low would clip the ratio above 1 on the low side",
        "le": "the ratio's lower clip 1 − ε_low cannot go below 0",
    }
}
CLIP_HIGH = {
    "why": {
        "ge": "a negative ε_high would clip the ratio below 1 on the high side",
        "le": "past a ratio of 101 the clip no longer bounds a step (the paper's Lp-Reg uses 9: ratio ≤ 10)",
    }
}
WEIGHT = {
    "why": {
        "ge": "a negative weight would reward what the term penalizes",
        "le": "a larger weight drowns the policy gradient, and in float32 can overflow it (the papers use 1)",
    }
}


class LpRegLoss(Section):
    """Lp-Reg (arXiv 2510.03222): PPO-clip plus a pull toward the min-p proxy on the lowest-prob tokens."""

    name: Literal["lp_reg"] = "lp_reg"
    rho: float = Field(
        0.01,
        ge=0,
        le=1,
        description="Fraction of A<0 tokens considered (lowest logp first).",
        json_schema_extra=FRACTION,
    )
    rho_pos: float = Field(
        0.0, ge=0, le=1, description="The same for A>0 tokens (0: off).", json_schema_extra=FRACTION
    )
    beta: float = Field(
        1.0, ge=0, le=100, description="Weight of the kl3 pull toward the proxy.", json_schema_extra=WEIGHT
    )
    clip_low: float = Field(
        1.0, ge=0, le=1, description="ε_low: ratio clipped below at 1 − ε_low.", json_schema_extra=CLIP_LOW
    )
    clip_high: float = Field(
        9.0,
        ge=0,
        le=100,
        description="ε_high: ratio clipped above at 1 + ε_high.",
        json_schema_extra=CLIP_HIGH,
    )


class PpoClipLoss(Section):
    """PPO/GRPO clipped surrogate."""

    name: Literal["ppo_clip", "grpo"] = "ppo_clip"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.", json_schema_extra=CLIP_LOW)
    clip_high: float = Field(0.2, ge=0, le=100, description="ε_high.", json_schema_extra=CLIP_HIGH)


class ClipHigherLoss(Section):
    """DAPO's Clip-Higher: asymmetric clip."""

    name: Literal["clip_higher"] = "clip_higher"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.", json_schema_extra=CLIP_LOW)
    clip_high: float = Field(0.28, ge=0, le=100, description="ε_high.", json_schema_extra=CLIP_HIGH)


class EntropyBonusLoss(Section):
    """GRPO + entropy loss."""

    name: Literal["entropy_bonus"] = "entropy_bonus"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.", json_schema_extra=CLIP_LOW)
    clip_high: float = Field(0.2, ge=0, le=100, description="ε_high.", json_schema_extra=CLIP_HIGH)
    entropy_coef: float = Field(
        0.001,
        ge=0,
        le=1,
        description="Weight of −entropy in the loss.",
        json_schema_extra={
            "why": {
                "ge": "a negative weight would push the entropy down, toward the collapse Lp-Reg prevents",
                "le": "a larger weight makes maximal entropy the objective: the policy goes uniform",
            }
        },
    )


class EightyTwentyLoss(Section):
    """80/20: only the highest-entropy tokens get policy gradient."""

    name: Literal["eighty_twenty"] = "eighty_twenty"
    top_frac: float = Field(
        0.2,
        gt=0,
        le=1,
        description="Fraction of valid tokens (highest entropy) trained.",
        json_schema_extra={"why": {"gt": "0 trains no token at all", "le": "it is a fraction of the tokens"}},
    )
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.", json_schema_extra=CLIP_LOW)
    clip_high: float = Field(0.28, ge=0, le=100, description="ε_high.", json_schema_extra=CLIP_HIGH)


class KlCovLoss(Section):
    """KL-Cov: a KL penalty on the tokens of highest covariance between logp and advantage."""

    name: Literal["kl_cov"] = "kl_cov"
    kl_cov_ratio: float = Field(
        2e-4, ge=0, le=1, description="Fraction of tokens penalized.", json_schema_extra=FRACTION
    )
    ppo_kl_coef: float = Field(
        1.0, ge=0, le=100, description="Weight of |logp − old_logp| on them.", json_schema_extra=WEIGHT
    )


# A token's covariance term (logp − mean)·(A − mean) stays within a few hundred for any real policy.
COV_LIMIT = 1000.0
COVARIANCE = {
    "why": {
        "ge": "a token's covariance term stays well inside ±1000",
        "le": "a token's covariance term stays well inside ±1000",
    }
}


class ClipCovLoss(Section):
    """Clip-Cov: detach a random few tokens whose covariance lies in [lb, ub]."""

    name: Literal["clip_cov"] = "clip_cov"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.", json_schema_extra=CLIP_LOW)
    clip_high: float = Field(0.2, ge=0, le=100, description="ε_high.", json_schema_extra=CLIP_HIGH)
    clip_cov_ratio: float = Field(
        2e-4, ge=0, le=1, description="Fraction of tokens detached.", json_schema_extra=FRACTION
    )
    clip_cov_lb: float = Field(
        1.0, ge=-COV_LIMIT, le=COV_LIMIT, description="Lower covariance bound.", json_schema_extra=COVARIANCE
    )
    clip_cov_ub: float = Field(
        5.0, ge=-COV_LIMIT, le=COV_LIMIT, description="Upper covariance bound.", json_schema_extra=COVARIANCE
    )


class GspoLoss(Section):
    """GSPO: sequence-level importance ratio."""

    name: Literal["gspo"] = "gspo"
    clip_low: float = Field(
        3e-4, ge=0, le=1, description="ε_low on the sequence ratio.", json_schema_extra=CLIP_LOW
    )
    clip_high: float = Field(
        4e-4, ge=0, le=100, description="ε_high on the sequence ratio.", json_schema_extra=CLIP_HIGH
    )


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
