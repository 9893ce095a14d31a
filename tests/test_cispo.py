"""CISPO (MiniMax-M1, arXiv 2506.13585, Eqs. 4-5) on hand-checked three-token cases: the loss, its
gradient (every token keeps one, clipped or not), the clip of the weight on both sides, the mask; and
that it is one file: registered, a variant of `learner.loss`, trained by the learner's path."""

from __future__ import annotations

import math

import torch
from torch.testing import assert_close

from sparkrl.services.common.losses import LOSSES, LossInputs, loss_spec, policy_loss
from sparkrl.services.common.losses.cispo import CispoLoss, cispo_loss
from sparkrl.services.common.settings import load_settings


def _t(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float64)


def test_hand_case_weights_each_token_by_its_clipped_detached_ratio() -> None:
    # ε_low = 0.5, ε_high = 1: the weight is clip(r, 0.5, 2).
    # Token 0: log r = ln 3 → r = 3 → weight 2 (clipped above); A = 1, logp = −1 → loss_0 = −2·1·(−1) = 2.
    # Token 1: log r = ln 0.25 → r = 0.25 → weight 0.5 (clipped below); A = −2, logp = −2 → −2.
    # Token 2: log r = 0 → weight 1; A = 1, logp = −0.5 → 0.5.   loss = (2 − 2 + 0.5) / 3 = 1/6.
    logp = _t(-1.0, -2.0, -0.5).requires_grad_()
    old_logp = _t(-1.0 - math.log(3), -2.0 - math.log(0.25), -0.5)
    cfg = CispoLoss(clip_low=0.5, clip_high=1.0)
    loss, stats = cispo_loss(logp, old_logp, _t(1, -2, 1), _t(1, 1, 1), cfg)
    assert_close(loss, torch.tensor(0.5 / 3, dtype=torch.float64))
    loss.backward()
    # d loss / d logp_t = −w_t·A_t / 3: the weight is a constant (stop-gradient), never a zero gradient.
    assert_close(logp.grad, _t(-2 / 3, 1 / 3, -1 / 3))
    assert_close(stats["clip_frac"], torch.tensor(2 / 3, dtype=torch.float64))


def test_defaults_leave_the_weight_unbounded_below_and_the_mask_out() -> None:
    # Default ε_low = 1: r = 0.1 keeps its weight 0.1. Token 1 masked: its −inf logp adds nothing, not NaN.
    logp = _t(-1.0, -math.inf, -1.0).requires_grad_()
    old_logp = _t(-1.0 - math.log(0.1), -1.0, -1.0)
    loss, _ = cispo_loss(logp, old_logp, _t(1, 1, -1), _t(1, 0, 1), CispoLoss())
    # Token 0: −0.1·1·(−1) = 0.1; token 2: −1·(−1)·(−1) = −1; over the 2 valid tokens: −0.45.
    assert_close(loss, torch.tensor(-0.45, dtype=torch.float64))
    loss.backward()
    assert_close(logp.grad, _t(-0.1 / 2, 0.0, 1 / 2))


def test_cispo_is_one_file_away() -> None:
    spec = loss_spec("cispo")
    assert spec.settings is CispoLoss and spec.zero_advantage_free and spec.needs == ("token_weights",)
    assert "cispo" in LOSSES
    cfg = load_settings("smoke", ["learner.loss.name=cispo", "learner.loss.clip_high=2.0"]).learner.loss
    assert isinstance(cfg, CispoLoss) and cfg.clip_high == 2.0
    inputs = LossInputs(logp=_t(-1.0, -1.0, -1.0), old_logp=_t(-1.0, -1.0, -1.0), advantages=_t(1, 1, 1),
                        mask=_t(1, 1, 1))  # fmt: skip
    # r = 1 → weight 1; each token −1·A·logp = −1·1·(−1) = 1.
    assert_close(policy_loss(inputs, cfg)[0], torch.tensor(1.0, dtype=torch.float64))
