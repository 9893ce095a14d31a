"""The baseline losses, each on a hand-checked three-token case, and the name → loss registry."""

from __future__ import annotations

import math

import pytest
import torch
from _losses import (
    clip_cov_loss,
    clip_higher_loss,
    eighty_twenty_loss,
    entropy_bonus_loss,
    gspo_loss,
    kl_cov_loss,
    loss_by_name,
    lp_reg_loss,
    ppo_clip_loss,
)
from torch.testing import assert_close

from sparkrl.services.common.losses import LOSSES, LossInputs, loss_spec


def _t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.float64)


def _scalar(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def _leaf(*rows: list[float]) -> torch.Tensor:
    return _t(*rows).requires_grad_()


ONES = _t([1, 1, 1])


def test_ppo_clip_both_sides() -> None:
    # ε = 0.2. Token 0: A = +1, r = 1.5 → max(−1.5, −1.2) = −1.2, clipped (no grad).
    # Token 1: A = −1, r = 0.5 → max(0.5, 0.8) = 0.8, clipped. Token 2: A = +1, r = 1 → −1, grad −1.
    logp = _leaf([math.log(1.5), math.log(0.5), 0.0])
    loss, stats = ppo_clip_loss(logp, _t([0, 0, 0]), _t([1, -1, 1]), ONES)
    assert_close(loss, _scalar((-1.2 + 0.8 - 1) / 3))
    loss.backward()
    assert_close(logp.grad, _t([0.0, 0.0, -1 / 3]))
    assert_close(stats["clip_frac"], _scalar(2 / 3))
    # ratio_kl = mean(old − logp) = −(log 1.5 + log 0.5 + 0)/3 = 0.095894
    assert_close(stats["ratio_kl"], _scalar(-(math.log(1.5) + math.log(0.5)) / 3))


def test_clip_higher_lets_positive_tokens_rise_further() -> None:
    # A = +1, r = 1.25: PPO-clip(0.2) gives −1.2 (clipped); Clip-Higher(0.28) gives −1.25 (not clipped).
    # Token 1: A = −1, r = 0.75 → both: max(0.75, 0.8) = 0.8 (ε_low is 0.2 in both). Token 2 masked.
    logp = _leaf([math.log(1.25), math.log(0.75), 5.0])
    old_logp, adv, mask = _t([0, 0, 0]), _t([1, -1, 7]), _t([1, 1, 0])
    assert_close(ppo_clip_loss(logp, old_logp, adv, mask)[0], _scalar((-1.2 + 0.8) / 2))
    loss, stats = clip_higher_loss(logp, old_logp, adv, mask)
    assert_close(loss, _scalar((-1.25 + 0.8) / 2))
    loss.backward()
    assert_close(logp.grad, _t([-1.25 / 2, 0.0, 0.0]))
    assert_close(stats["clip_frac"], _scalar(0.5))


def test_entropy_bonus_subtracts_coef_times_mean_entropy() -> None:
    # r = 1, A = [1, −1, 1] → PPO part (−1 + 1 − 1)/3 = −1/3; entropy [1, 2, 3] → −0.001·2 = −0.002.
    entropy = _leaf([1.0, 2.0, 3.0])
    loss, stats = entropy_bonus_loss(_t([0, 0, 0]), _t([0, 0, 0]), _t([1, -1, 1]), ONES, entropy)
    assert_close(loss, _scalar(-1 / 3 - 0.002))
    loss.backward()
    assert_close(entropy.grad, _t([-0.001 / 3] * 3))  # d/dH_t of −c·mean H
    assert_close(stats["entropy"], _scalar(2.0))


def test_eighty_twenty_trains_only_the_highest_entropy_tokens() -> None:
    # 5 valid tokens → max(1, int(5·0.2)) = 1 trained token: the highest entropy, token 1 (0.9).
    # r = 1, A_1 = −1 → loss = −A·r = 1 over |S| = 1; only token 1 gets gradient (−A·r = 1).
    logp = _leaf([-1.0, -1.0, -1.0, -1.0, -1.0])
    entropy = _t([0.1, 0.9, 0.5, 0.3, 0.2])
    loss, stats = eighty_twenty_loss(logp, logp.detach(), _t([1, -1, 1, 1, 1]), _t([1] * 5), entropy)
    assert_close(loss, _scalar(1.0))
    loss.backward()
    assert_close(logp.grad, _t([0.0, 1.0, 0.0, 0.0, 0.0]))
    assert_close(stats["trained_frac"], _scalar(0.2))
    # A masked token never counts, however high its entropy.
    loss, _ = eighty_twenty_loss(logp, logp.detach(), _t([1, -1, 1, 1, 1]), _t([1, 0, 1, 1, 1]), entropy)
    assert_close(loss, _scalar(-1.0))  # token 2 (0.5) now wins: A = +1 → −1


def test_kl_cov_penalizes_the_largest_covariance_token_without_clip() -> None:
    # A = [1, −1, 0], logp = [−1, −2, −3] → mean A = 0, mean logp = −2 → cov = [1·1, −1·0, 0·−1] = [1, 0, 0].
    # k = max(1, int(3·2e-4)) = 1 → token 0. log r = [0.5, 0.2, 0].
    # loss_0 = −e^0.5 + |0.5| = −1.148721 (no clip, though r = 1.65 > 1.2); loss_1 = e^0.2; loss_2 = 0.
    logp = _leaf([-1.0, -2.0, -3.0])
    loss, stats = kl_cov_loss(logp, _t([-1.5, -2.2, -3.0]), _t([1, -1, 0]), ONES)
    assert_close(loss, _scalar((-math.exp(0.5) + 0.5 + math.exp(0.2)) / 3))
    loss.backward()
    # grads: token 0: −A·r + c·sign(log r) = −e^0.5 + 1; token 1: −A·r = e^0.2; token 2: 0.
    assert_close(logp.grad, _t([(1 - math.exp(0.5)) / 3, math.exp(0.2) / 3, 0.0]))
    assert_close(stats["reg_frac"], _scalar(1 / 3))
    assert stats["clip_frac"] == 0


def test_clip_cov_detaches_a_random_high_covariance_token() -> None:
    # A = [2, −2, 0], logp = [−1, −3, −2] → cov = [2·1, −2·−1, 0] = [2, 2, 0]: tokens 0, 1 in (1, 5).
    # log r = [0.1, −0.1, 0] (inside ε = 0.2). One token (max(1, int(3·2e-4)) = 1) is drawn and gets loss 0.
    # Token 0 drawn → (0 + 2·e^−0.1)/3 = 0.603225; token 1 drawn → (−2·e^0.1)/3 = −0.736781.
    def run(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        logp = _leaf([-1.0, -3.0, -2.0])
        g = torch.Generator().manual_seed(seed)
        loss, stats = clip_cov_loss(logp, _t([-1.1, -2.9, -2.0]), _t([2, -2, 0]), ONES, generator=g)
        loss.backward()
        assert_close(stats["cov_clip_frac"], _scalar(1 / 3))
        return loss.detach(), logp.grad

    outcomes = {round(float(run(seed)[0]), 6) for seed in range(16)}
    assert outcomes == {round(2 * math.exp(-0.1) / 3, 6), round(-2 * math.exp(0.1) / 3, 6)}
    loss_a, grad_a = run(3)
    loss_b, grad_b = run(3)
    assert_close(loss_a, loss_b)  # same generator seed, same draw
    assert_close(grad_a, grad_b)
    assert (grad_a == 0).sum() == 2  # the drawn token and the A = 0 token


def test_clip_cov_never_draws_an_already_clipped_token() -> None:
    # As above but token 0 has log r = 0.5 → r = 1.6487 > 1.2: PPO-clipped, so only token 1 is eligible.
    # loss = (−2·1.2 + 0 + 0)/3 = −0.8 whatever the draw.
    loss, stats = clip_cov_loss(_t([-1.0, -3.0, -2.0]), _t([-1.5, -2.9, -2.0]), _t([2, -2, 0]), ONES)
    assert_close(loss, _scalar(-0.8))
    assert_close(stats["clip_frac"], _scalar(1 / 3))


def test_gspo_sequence_ratio_clip_and_seq_mean() -> None:
    # Row 0: log r = [1e-4, 2e-4, 3e-4] → s = e^{2e-4} = 1.00020002, inside [1 − 3e-4, 1 + 4e-4];
    #   A = +1 → loss per token −s, gradient −A·s per token.
    # Row 1: log r = [1e-3, 1e-3, (masked)] → s = e^{1e-3} > 1 + 4e-4 → clipped: −1.0004, no gradient.
    # Row 2: fully masked → left out of the sequence mean.  loss = (−e^{2e-4} − 1.0004)/2.
    logp = _leaf([1e-4, 2e-4, 3e-4], [1e-3, 1e-3, 9.0], [0.0, 0.0, 0.0])
    old_logp, adv = torch.zeros(3, 3, dtype=torch.float64), torch.ones(3, 3, dtype=torch.float64)
    mask = _t([1, 1, 1], [1, 1, 0], [0, 0, 0])
    loss, stats = gspo_loss(logp, old_logp, adv, mask)
    assert_close(loss, _scalar((-math.exp(2e-4) - 1.0004) / 2))
    loss.backward()
    # d/dlogp_{0,t}: −A·s / (3 tokens) / (2 sequences)
    row0 = -math.exp(2e-4) / 6
    assert_close(logp.grad, _t([row0] * 3, [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]))
    assert_close(stats["clip_frac"], _scalar(2 / 5))


def test_lp_reg_entry_is_the_lp_reg_loss() -> None:
    batch = _random_inputs(seed=1)
    direct, _ = lp_reg_loss(
        batch.logp, batch.old_logp, batch.proxy_logp, batch.advantages, batch.mask, rho=0.1
    )
    via_registry, _ = loss_by_name("lp_reg", batch, rho=0.1)
    assert_close(via_registry, direct)


def _random_inputs(seed: int, B: int = 4, T: int = 40) -> LossInputs:
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g) * 5).requires_grad_()
    filtered = torch.rand(B, T, generator=g) < 0.3
    return LossInputs(
        logp=logp,
        old_logp=logp.detach() + 0.2 * torch.randn(B, T, generator=g),
        advantages=torch.randn(B, 1, generator=g).expand(B, T),
        mask=torch.rand(B, T, generator=g) < 0.8,
        proxy_logp=torch.where(filtered, -math.inf, logp.detach() + torch.randn(B, T, generator=g)),
        entropy=torch.rand(B, T, generator=g).requires_grad_(),
    )


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_registered_loss_runs_with_finite_loss_and_grads(name: str) -> None:
    inputs = _random_inputs(seed=0)
    loss, stats = loss_by_name(name, inputs)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert inputs.logp.grad is not None and torch.isfinite(inputs.logp.grad).all()
    assert inputs.logp.grad.abs().sum() > 0
    assert {"clip_frac", "ratio_kl"} <= set(stats)
    assert all(not v.requires_grad for v in stats.values())


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_accepts_token_weights_and_unit_weights_change_nothing(name: str) -> None:
    inputs = _random_inputs(seed=2)
    torch.manual_seed(0)  # Clip-Cov draws from torch's default generator
    plain, _ = loss_by_name(name, inputs)
    ones = LossInputs(**{**inputs.__dict__, "token_weights": torch.ones_like(inputs.old_logp)})
    torch.manual_seed(0)
    weighted, _ = loss_by_name(name, ones)
    assert_close(weighted, plain)


def test_grpo_is_ppo_clip() -> None:
    inputs = _random_inputs(seed=3)
    assert_close(loss_by_name("grpo", inputs)[0], loss_by_name("ppo_clip", inputs)[0])


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match=r"lp_reg.*ppo_clip"):
        loss_spec("ppo")


@pytest.mark.parametrize(("name", "missing"), [("lp_reg", "proxy_logp"), ("eighty_twenty", "entropy")])
def test_missing_input_is_a_clear_error(name: str, missing: str) -> None:
    inputs = LossInputs(**{**_random_inputs(seed=0).__dict__, missing: None})
    with pytest.raises(ValueError, match=missing):
        loss_by_name(name, inputs)


def test_unknown_hparam_fails_loudly() -> None:
    with pytest.raises(ValueError, match="rho"):  # the settings class forbids what it does not hold
        loss_by_name("ppo_clip", _random_inputs(seed=0), rho=0.1)
