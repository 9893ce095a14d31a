"""Policy losses: Lp-Reg (`lp_reg.py`), the paper's baselines (`baselines.py`), shared pieces
(`common.py`), and the name → loss registry (`registry.py`)."""

from sparkrl.services.learner.losses.baselines import (
    clip_cov_loss,
    clip_higher_loss,
    eighty_twenty_loss,
    entropy_bonus_loss,
    gspo_loss,
    kl_cov_loss,
    ppo_clip_loss,
)
from sparkrl.services.learner.losses.lp_reg import lp_reg_loss
from sparkrl.services.learner.losses.registry import (
    POLICY_LOSSES,
    LossInputs,
    entropy_has_gradient,
    policy_loss,
    skips_zero_advantage,
)

__all__ = [
    "POLICY_LOSSES",
    "LossInputs",
    "clip_cov_loss",
    "clip_higher_loss",
    "eighty_twenty_loss",
    "entropy_bonus_loss",
    "entropy_has_gradient",
    "gspo_loss",
    "kl_cov_loss",
    "lp_reg_loss",
    "policy_loss",
    "ppo_clip_loss",
    "skips_zero_advantage",
]
