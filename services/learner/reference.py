"""The KL penalty to a frozen reference model (`learner.kl`): the estimators and the reference's pass.

k1 = log π − log π_ref; k2 = ½ (log π − log π_ref)²; k3 = π_ref/π − log(π_ref/π) − 1 (Schulman, "Approximating
KL divergence"; verl's `kl_penalty` names them `kl`, `mse`, `low_var_kl`). Each is per token, [B, T]; the
penalty is `coef` × its token mean, added to whatever the policy loss is. k3 is clamped to [−10, 10] like
verl's `low_var_kl`, so one token far off the reference cannot swamp a step.
"""

from __future__ import annotations

import torch
from torch import Tensor

K3_CLAMP = 10.0


def kl_to_reference(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimate of π (logp, carries gradient) from π_ref (ref_logp, a constant)."""
    diff = logp - ref_logp.detach()
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        return (torch.exp(-diff) + diff - 1.0).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2, k3)")


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The reference: the initial weights, in eval mode, without gradients."""
    import copy

    reference = copy.deepcopy(model).eval()
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    return reference
