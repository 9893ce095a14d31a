"""Learner: advantages, losses (Lp-Reg and baselines), DeepSpeed engine, weight broadcast, control API."""

from sparkrl.services.learner.advantages import group_advantages, truncated_is_metrics, truncated_is_weights
from sparkrl.services.learner.losses import POLICY_LOSSES, LossInputs, lp_reg_loss, policy_loss
from sparkrl.services.learner.proxy import (
    FILTERED_LOGP,
    proxy_logp_from_logits,
    proxy_logp_from_topk,
    proxy_metrics,
)

__all__ = [
    "FILTERED_LOGP",
    "POLICY_LOSSES",
    "LossInputs",
    "group_advantages",
    "lp_reg_loss",
    "policy_loss",
    "proxy_logp_from_logits",
    "proxy_logp_from_topk",
    "proxy_metrics",
    "truncated_is_metrics",
    "truncated_is_weights",
]
