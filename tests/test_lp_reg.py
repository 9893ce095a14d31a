"""Lp-Reg loss (docs/architecture.md, "Lp-Reg, exactly"): hand-checked three-token cases, then a
token-by-token reference implementation compared on random batches (values and gradients)."""

from __future__ import annotations

import math

import pytest
import torch
from _losses import lp_reg_loss, ppo_clip_loss
from torch.testing import assert_close

INF = float("inf")


def _t(*values: float) -> torch.Tensor:
    """A [1, 3] float64 row (float64 so hand-derived decimals compare tightly)."""
    return torch.tensor([values], dtype=torch.float64)


def _leaf(*values: float) -> torch.Tensor:
    return _t(*values).requires_grad_()


def test_hand_case_regularizes_lowest_logp_token_with_finite_proxy() -> None:
    # logp = old_logp → r = 1 everywhere; A = −1 everywhere, rho = 0.7 → k_neg = int(3·0.7) = 2 > 1.
    # Two lowest logp: tokens 0 (−3) and 1 (−2). Token 0: logp −3 < proxy −1 → regularized.
    # Token 1: proxy −inf → never regularized. Token 2: not among the two lowest.
    # Token 0: d = −1 − (−3) = 2, kl3 = e² − 2 − 1 = 4.389056; loss_0 = −A·r + kl3 = 1 + 4.389056.
    # Tokens 1, 2: max(−A·r, −A·clip(r, 0, 10)) = 1.  loss = (5.389056 + 1 + 1) / 3 = 2.129685.
    logp = _leaf(-3.0, -2.0, -1.0)
    old_logp, proxy_logp = _t(-3.0, -2.0, -1.0), _t(-1.0, -INF, -2.0)
    loss, stats = lp_reg_loss(logp, old_logp, proxy_logp, _t(-1, -1, -1), _t(1, 1, 1), rho=0.7)
    assert_close(loss, torch.tensor((math.e**2 - 3 + 1 + 2) / 3, dtype=torch.float64))
    loss.backward()
    # d/dlogp_0: −A·r = 1 from the ratio, 1 − e^{d} = 1 − e² from kl3 → (2 − e²)/3 = −1.796352.
    # Tokens 1, 2: −A·r = 1 → 1/3 each.
    assert_close(logp.grad, _t((2 - math.e**2) / 3, 1 / 3, 1 / 3))
    assert stats["reg_tokens"] == 1 and stats["reg_tokens_pos"] == 0 and stats["k_neg"] == 2
    assert_close(stats["kl3_mean"], torch.tensor(math.e**2 - 3, dtype=torch.float64))
    assert_close(stats["ratio_kl"], torch.tensor(0.0, dtype=torch.float64))
    # The regularizer's share of the gradient on token 0: |1 − e²| against |−A·r| = 1.
    assert_close(stats["reg_grad_share"], torch.tensor((math.e**2 - 1) / math.e**2, dtype=torch.float64))


def test_regularized_token_is_not_clipped_and_kl3_saturates_at_10() -> None:
    # All A = −1, rho = 1 → k = 3, all three selected; logp < proxy on all three. ε_low = 0.5.
    # Token 0: log r = −2 → r = e⁻² = 0.135335. An ordinary token would be clipped: max(0.135, 0.5) = 0.5.
    #   Regularized, it is not: −A·r = e⁻². d = −0.5 − (−5) = 4.5 → e^4.5 − 5.5 = 84.5 → clamped to 10,
    #   so its kl3 contributes no gradient.
    # Token 1: r = 1, d = 0.5 → kl3 = e^0.5 − 1.5 = 0.148721.  Token 2: r = 1, d = 1 → kl3 = e − 2.
    logp = _leaf(-5.0, -1.5, -2.0)
    old_logp, proxy_logp = _t(-3.0, -1.5, -2.0), _t(-0.5, -1.0, -1.0)
    loss, stats = lp_reg_loss(logp, old_logp, proxy_logp, _t(-1, -1, -1), _t(1, 1, 1), rho=1.0, clip_low=0.5)
    expected = (math.e**-2 + 10) + (1 + math.e**0.5 - 1.5) + (1 + math.e - 2)
    assert_close(loss, torch.tensor(expected / 3, dtype=torch.float64))
    loss.backward()
    # Gradients: token 0: r = e⁻² (kl3 saturated, no clip); token 1: 1 + (1 − e^0.5); token 2: 1 + (1 − e).
    assert_close(logp.grad, _t(math.e**-2 / 3, (2 - math.e**0.5) / 3, (2 - math.e) / 3))
    assert stats["reg_tokens"] == 3 and stats["clip_frac"] == 0
    assert_close(
        stats["kl3_mean"], torch.tensor((10 + math.e**0.5 - 1.5 + math.e - 2) / 3, dtype=torch.float64)
    )
    # Its share: token 0's kl3 sits at the clamp (no gradient); tokens 1, 2 give |1 − e^0.5|, |1 − e|
    # against the policy gradient's e⁻², 1, 1.
    reg = (math.e**0.5 - 1) + (math.e - 1)
    assert_close(stats["reg_grad_share"], torch.tensor(reg / (reg + math.e**-2 + 2), dtype=torch.float64))


def test_both_clip_sides_with_paper_range() -> None:
    # rho = 0 → plain clip with ε_low = 1, ε_high = 9, i.e. r clipped to [0, 10].
    # Token 0: A = +1, r = 12 → max(−12, −10) = −10 (clipped, no gradient).
    # Token 1: A = −1, r = 12 → max(12, 10) = 12 (unclipped, gradient −A·r = 12).
    # Token 2: A = +1, r = 0.5 → max(−0.5, −0.5) = −0.5 (r ≥ 0 is never clipped below; gradient −0.5).
    log12, log05 = math.log(12.0), math.log(0.5)
    logp = _leaf(log12, log12, log05)
    loss, stats = lp_reg_loss(logp, _t(0, 0, 0), _t(0, 0, 0), _t(1, -1, 1), _t(1, 1, 1), rho=0.0)
    assert_close(loss, torch.tensor((-10 + 12 - 0.5) / 3, dtype=torch.float64))
    loss.backward()
    assert_close(logp.grad, _t(0.0, 12 / 3, -0.5 / 3))
    assert_close(stats["clip_frac"], torch.tensor(1 / 3, dtype=torch.float64))
    assert_close(stats["ratio_mean"], torch.tensor((12 + 12 + 0.5) / 3, dtype=torch.float64))


def test_both_clip_sides_with_narrow_range() -> None:
    # ε = 0.2.  Token 0: A = +1, r = 1.5 → max(−1.5, −1.2) = −1.2 (clipped high).
    # Token 1: A = −1, r = 0.5 → max(0.5, 0.8) = 0.8 (clipped low).  Token 2: A = +1, r = 1 → −1.
    logp = _leaf(math.log(1.5), math.log(0.5), 0.0)
    loss, stats = lp_reg_loss(
        logp, _t(0, 0, 0), _t(0, 0, 0), _t(1, -1, 1), _t(1, 1, 1), rho=0.0, clip_low=0.2, clip_high=0.2
    )
    assert_close(loss, torch.tensor((-1.2 + 0.8 - 1) / 3, dtype=torch.float64))
    loss.backward()
    assert_close(logp.grad, _t(0.0, 0.0, -1 / 3))
    assert_close(stats["clip_frac"], torch.tensor(2 / 3, dtype=torch.float64))


def test_masked_token_is_ignored_even_when_it_holds_garbage() -> None:
    # Token 2 is masked and holds −inf / NaN everywhere; tokens 0, 1: r = 1, A = ±1 → losses −1, +1.
    # Token-mean over the two valid tokens: 0. Gradients: −A·r = −1, +1 over 2 tokens; 0 on token 2.
    logp = _leaf(-1.0, -1.0, -INF)
    old_logp, proxy_logp = _t(-1.0, -1.0, math.nan), _t(math.nan, -INF, math.nan)
    loss, _ = lp_reg_loss(logp, old_logp, proxy_logp, _t(1, -1, math.nan), _t(1, 1, 0), rho=1.0)
    assert_close(loss, torch.tensor(0.0, dtype=torch.float64))
    loss.backward()
    assert_close(logp.grad, _t(-0.5, 0.5, 0.0))


def test_empty_mask_gives_zero_loss_with_a_gradient_path() -> None:
    logp = _leaf(-1.0, -2.0, -3.0)
    loss, stats = lp_reg_loss(logp, _t(0, 0, 0), _t(0, 0, 0), _t(-1, -1, -1), _t(0, 0, 0), rho=1.0)
    assert_close(loss, torch.tensor(0.0, dtype=torch.float64))
    loss.backward()
    assert_close(logp.grad, _t(0.0, 0.0, 0.0))
    assert stats["reg_tokens"] == 0 and stats["clip_frac"] == 0 and stats["kl3_mean"] == 0


@pytest.mark.parametrize("rho", [0.0, 0.34, 0.66])  # k_neg = int(3·ρ) = 0, 1, 1: never > 1
def test_k_at_most_one_regularizes_nothing(rho: float) -> None:
    # Every token would qualify (A < 0, logp < proxy), but k ≤ 1 switches the regularizer off.
    logp, old_logp, proxy_logp = _t(-3, -2, -1), _t(-3, -2, -1), _t(0, 0, 0)
    loss, stats = lp_reg_loss(logp, old_logp, proxy_logp, _t(-1, -1, -1), _t(1, 1, 1), rho=rho)
    assert_close(loss, torch.tensor(1.0, dtype=torch.float64))  # −A·r = 1 on each token
    assert stats["reg_tokens"] == 0


def test_no_negative_tokens_means_no_regularization_unless_rho_pos() -> None:
    # All A = +1, r = 1 → base loss −1 each. rho = 1 has nothing to act on.
    logp, proxy_logp = _t(-3, -2, -1), _t(0, 0, 0)
    loss, stats = lp_reg_loss(logp, logp, proxy_logp, _t(1, 1, 1), _t(1, 1, 1), rho=1.0)
    assert_close(loss, torch.tensor(-1.0, dtype=torch.float64))
    assert stats["reg_tokens"] == 0 and stats["reg_tokens_pos"] == 0
    # rho_pos = 0.7 → k_pos = 2: tokens 0, 1 (logp −3, −2), both below proxy 0.
    # kl3: d = 3 → e³ − 4 = 16.09 → 10 (clamped); d = 2 → e² − 3 = 4.389056.
    loss, stats = lp_reg_loss(logp, logp, proxy_logp, _t(1, 1, 1), _t(1, 1, 1), rho=1.0, rho_pos=0.7)
    assert_close(loss, torch.tensor((-1 + 10 - 1 + math.e**2 - 3 - 1) / 3, dtype=torch.float64))
    assert stats["reg_tokens"] == 0 and stats["reg_tokens_pos"] == 2


def test_ties_in_logp_break_by_position() -> None:
    # Four equal logp, A < 0, rho = 0.5 → k = 2: the first two positions (row-major) are chosen.
    logp = torch.full((2, 2), -2.0, dtype=torch.float64, requires_grad=True)
    proxy_logp = torch.zeros(2, 2, dtype=torch.float64)
    loss, stats = lp_reg_loss(logp, logp.detach(), proxy_logp, -torch.ones(2, 2), torch.ones(2, 2), rho=0.5)
    loss.backward()
    regularized = logp.grad != logp.grad[1, 1]
    assert regularized.tolist() == [[True, True], [False, False]]
    assert stats["reg_tokens"] == 2


def test_all_filtered_proxy_never_nans() -> None:
    torch.manual_seed(0)
    logp = (-torch.rand(4, 50) * 8).requires_grad_()
    proxy_logp = torch.full((4, 50), -INF)
    loss, stats = lp_reg_loss(logp, logp.detach() + 0.1, proxy_logp, -torch.ones(4, 50), torch.ones(4, 50))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert stats["reg_tokens"] == 0 and stats["kl3_mean"] == 0


def _random_batch(seed: int, B: int = 4, T: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 6
    filtered = torch.rand(B, T, generator=g) < 0.3
    proxy = torch.where(filtered, -INF, logp + torch.randn(B, T, generator=g, dtype=torch.float64))
    return {
        "logp": logp,
        "old_logp": logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "proxy_logp": proxy,
        # rows alternate sign so both the A < 0 and A > 0 selections have tokens to act on
        "advantages": (torch.rand(B, 1, generator=g, dtype=torch.float64) + 0.1)
        * torch.tensor([[(-1.0) ** b] for b in range(B)], dtype=torch.float64).expand(B, T),
        "mask": torch.rand(B, T, generator=g) < 0.85,
    }


def _reference_lp_reg(batch: dict[str, torch.Tensor], logp: torch.Tensor, **hp: float) -> torch.Tensor:
    """docs/architecture.md's "Lp-Reg, exactly" read literally, one token at a time."""
    flat = {k: v.reshape(-1) for k, v in batch.items()}
    lp = logp.reshape(-1)
    lp_value = lp.detach()
    valid = [i for i in range(lp.numel()) if flat["mask"][i]]
    regularized: set[int] = set()
    for sign, rho in ((-1, hp["rho"]), (1, hp["rho_pos"])):
        group = [i for i in valid if sign * flat["advantages"][i] > 0]
        k = int(len(group) * rho)
        if k > 1:
            lowest = sorted(group, key=lambda i: (float(lp_value[i]), i))[:k]
            regularized |= {i for i in lowest if float(lp_value[i]) < float(flat["proxy_logp"][i])}
    total = lp.sum() * 0.0
    for i in valid:
        a, r = flat["advantages"][i], torch.exp(lp[i] - flat["old_logp"][i])
        if i in regularized:
            d = flat["proxy_logp"][i] - lp[i]
            total = total - a * r + hp["beta"] * torch.clamp(torch.exp(d) - d - 1, -10, 10)
        else:
            clipped = torch.clamp(r, 1 - hp["clip_low"], 1 + hp["clip_high"])
            total = total + torch.maximum(-a * r, -a * clipped)
    return total / max(len(valid), 1)


@pytest.mark.parametrize("seed", range(4))
def test_matches_token_by_token_reference(seed: int) -> None:
    hp = {"rho": 0.1, "rho_pos": 0.05 * (seed % 2), "beta": 0.7, "clip_low": 0.5, "clip_high": 2.0}
    batch = _random_batch(seed)
    logp = batch["logp"].clone().requires_grad_()
    loss, stats = lp_reg_loss(logp, **{k: v for k, v in batch.items() if k != "logp"}, **hp)
    (grad,) = torch.autograd.grad(loss, logp)
    ref_logp = batch["logp"].clone().requires_grad_()
    ref = _reference_lp_reg(batch, ref_logp, **hp)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    # the case exercises the regularizer, on the A > 0 side too when rho_pos is on
    assert stats["reg_tokens"] > 0 and (stats["reg_tokens_pos"] > 0) == (hp["rho_pos"] > 0)
    assert_close(loss, ref, atol=1e-10, rtol=1e-10)
    assert_close(grad, ref_grad, atol=1e-10, rtol=1e-10)


def test_regularizer_changes_gradient_only_on_selected_tokens() -> None:
    batch = _random_batch(7)
    # proxy = logp + 0.5 on every token: kl3 unsaturated (d = 0.5), so every selected token's grad moves.
    batch["proxy_logp"] = batch["logp"] + 0.5
    inputs = {k: v for k, v in batch.items() if k not in ("logp",)}
    grads = []
    for rho in (0.0, 0.1):
        logp = batch["logp"].clone().requires_grad_()
        loss, _ = lp_reg_loss(logp, **inputs, rho=rho)
        grads.append(torch.autograd.grad(loss, logp)[0])
    # Independently: the int(N_neg·0.1) valid negative tokens with the lowest logp.
    neg = batch["mask"] & (batch["advantages"] < 0)
    k = int(int(neg.sum()) * 0.1)
    assert k > 1
    lowest = torch.where(neg, batch["logp"], INF).reshape(-1).topk(k, largest=False).indices
    expected = torch.zeros(neg.numel(), dtype=torch.bool)
    expected[lowest] = True
    assert ((grads[0] != grads[1]).reshape(-1) == expected).all()


def test_rho_zero_equals_ppo_clip_with_paper_range() -> None:
    batch = _random_batch(3)
    results = []
    for loss_fn in ("lp_reg", "ppo_clip"):
        logp = batch["logp"].clone().requires_grad_()
        common = {"old_logp": batch["old_logp"], "advantages": batch["advantages"], "mask": batch["mask"]}
        if loss_fn == "lp_reg":
            loss, _ = lp_reg_loss(logp, proxy_logp=batch["proxy_logp"], **common, rho=0.0)
        else:
            loss, _ = ppo_clip_loss(logp, **common, clip_low=1.0, clip_high=9.0)
        results.append((loss, torch.autograd.grad(loss, logp)[0]))
    assert_close(results[0][0], results[1][0])
    assert_close(results[0][1], results[1][1])


def test_token_weights_multiply_each_token_and_none_changes_nothing() -> None:
    batch = _random_batch(5)
    plain, _ = lp_reg_loss(**batch, rho=0.1)
    ones, _ = lp_reg_loss(**batch, rho=0.1, token_weights=torch.ones_like(batch["logp"]))
    twos, _ = lp_reg_loss(**batch, rho=0.1, token_weights=torch.full_like(batch["logp"], 2.0))
    assert_close(plain, ones)
    assert_close(twos, 2 * plain)


def test_bf16_inputs_compute_in_float32_without_nan() -> None:
    batch = _random_batch(11)
    logp = batch["logp"].to(torch.bfloat16).requires_grad_()
    loss, _ = lp_reg_loss(logp, **{k: v for k, v in batch.items() if k != "logp"}, rho=0.1)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert logp.grad.dtype == torch.bfloat16 and torch.isfinite(logp.grad).all()
