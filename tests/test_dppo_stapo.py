"""DPPO (binary TV, arXiv 2602.04879) and STAPO (arXiv 2602.15620) on hand-worked cases: which tokens each
masks, the loss, its gradient; and that each is one file: registered, a variant of `learner.loss`."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from sparkrl.services.common.losses import LOSSES, LossInputs, loss_spec, policy_loss
from sparkrl.services.common.losses.dppo import DppoLoss, dppo_loss
from sparkrl.services.common.losses.ppo_clip import PpoClipLoss, ppo_clip_loss
from sparkrl.services.common.losses.stapo import StapoLoss, stapo_loss
from sparkrl.services.common.settings import load_settings

L = math.log


def _t(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float64)


def test_dppo_masks_by_how_far_the_probability_moved_not_by_the_ratio() -> None:
    # δ = 0.2 both ways, C = 10. Per token (A, π_old → π):
    #   0: (+1, 0.5 → 0.8)     rose 0.3 > 0.2: masked, no gradient
    #   1: (+1, 0.5 → 0.6)     rose 0.1: kept; r = 1.2 → −1·1.2·ln 0.6
    #   2: (−1, 0.5 → 0.2)     fell 0.3: masked
    #   3: (+1, 0.01 → 0.05)   rose 0.04: kept though r = 5 (PPO's clip at 1.2 would drop it) → −5·ln 0.05
    #   4: (+1, 0.001 → 0.02)  rose 0.019: kept; r = 20, weight capped at C = 10 → −10·ln 0.02
    old = _t(L(0.5), L(0.5), L(0.5), L(0.01), L(0.001))
    logp = _t(L(0.8), L(0.6), L(0.2), L(0.05), L(0.02)).requires_grad_()
    adv, mask = _t(1, 1, -1, 1, 1), _t(1, 1, 1, 1, 1)
    loss, stats = dppo_loss(logp, old, adv, mask, DppoLoss())
    expected = (-1.2 * L(0.6) - 5 * L(0.05) - 10 * L(0.02)) / 5
    assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    loss.backward()
    # d loss / d logp_t = −A_t·w_t / 5 on kept tokens (the weight is a constant), 0 on masked ones.
    assert_close(logp.grad, _t(0.0, -1.2 / 5, 0.0, -5 / 5, -10 / 5))
    assert (float(stats["masked_pos_tokens"]), float(stats["masked_neg_tokens"])) == (1.0, 1.0)
    assert_close(stats["clip_frac"], torch.tensor(2 / 5, dtype=torch.float64))
    # PPO-clip on the same tokens gives token 3 (r = 5 > 1.2, A > 0) no gradient: the contrast DPPO makes.
    logp_ppo = logp.detach().clone().requires_grad_()
    ppo_clip_loss(logp_ppo, old, adv, mask, PpoClipLoss())[0].backward()
    assert float(logp_ppo.grad[0, 3]) == 0.0


def test_dppo_ignores_padding_and_zero_advantages() -> None:
    logp = _t(L(0.5), -math.inf, L(0.9)).requires_grad_()
    old = _t(L(0.5), math.nan, L(0.1))
    loss, stats = dppo_loss(logp, old, _t(-2, 1, 0), _t(1, 0, 1), DppoLoss())
    # Token 0: r = 1, A = −2 → 2·ln 0.5; token 2: A = 0 → 0 (and not counted as masked); over 2 valid.
    assert_close(loss, torch.tensor(2 * L(0.5) / 2, dtype=torch.float64))
    loss.backward()
    assert torch.isfinite(logp.grad).all() and float(stats["clip_frac"]) == 0.0


def test_stapo_silences_positive_rare_confident_tokens_and_renormalizes() -> None:
    # The valid tokens' entropies 0.1, 0.2, 2, 3 at quantile 0.5: τ_h = 1.1 (padding's 4 not counted).
    # τ_p = 0.01. r = 1 everywhere.
    #   0: A = +1, π = 0.005, H = 0.1   spurious: silenced
    #   1: A = −1, π = 0.005, H = 0.2   negative advantage: kept
    #   2: A = +1, π = 0.005, H = 2.0   entropy above τ_h: kept
    #   3: A = +1, π = 0.5,   H = 3.0   kept
    #   4: padding
    logp = _t(L(0.005), L(0.005), L(0.005), L(0.5), -math.inf).requires_grad_()
    old = logp.detach().clone()
    adv, mask = _t(1, -1, 1, 1, 1), _t(1, 1, 1, 1, 0)
    entropy = _t(0.1, 0.2, 2.0, 3.0, 4.0)
    loss, stats = stapo_loss(logp, old, adv, mask, StapoLoss(entropy_quantile=0.5), entropy=entropy)
    # ppo_clip_t = −A·r = −A; kept: +1 − 1 − 1, over the 3 kept tokens (GRPO would average 4: −0.5).
    assert_close(loss, torch.tensor(-1 / 3, dtype=torch.float64))
    loss.backward()
    assert_close(logp.grad, _t(0.0, 1 / 3, -1 / 3, -1 / 3, 0.0))
    assert float(stats["spurious_tokens"]) == 1.0 and abs(float(stats["entropy_threshold"]) - 1.1) < 1e-12
    grpo, _ = ppo_clip_loss(logp.detach(), old, adv, mask, PpoClipLoss())
    assert_close(grpo, torch.tensor(-0.5, dtype=torch.float64))


@pytest.mark.parametrize(("name", "settings"), [("dppo", DppoLoss), ("stapo", StapoLoss)])
def test_each_is_one_file_away(name: str, settings: type) -> None:
    spec = loss_spec(name)
    assert name in LOSSES and spec.settings is settings and spec.zero_advantage_free
    assert spec.needs == (("entropy", "token_weights") if name == "stapo" else ("token_weights",))
    assert spec.own_aggregation == (name == "stapo")  # STAPO averages over the tokens it keeps
    cfg = load_settings("smoke", [f"learner.loss.name={name}"]).learner.loss
    assert isinstance(cfg, settings)
    inputs = LossInputs(logp=_t(-1.0, -1.0), old_logp=_t(-1.0, -1.0), advantages=_t(1, -1), mask=_t(1, 1),
                        entropy=_t(1.0, 1.0))  # fmt: skip
    # r = 1, nothing masked or silenced: each token −A·logp (DPPO) or −A·r (STAPO), A = ±1: mean 0.
    assert_close(policy_loss(inputs, cfg)[0], torch.tensor(0.0, dtype=torch.float64))
