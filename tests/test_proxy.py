"""Lp-Reg's min-p proxy: from full logits (reference) and from the rollout's top-k, and their agreement."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch.testing import assert_close

from sparkrl.services.learner.proxy import proxy_logp_from_logits, proxy_logp_from_topk

INF = float("inf")


def _naive_proxy(
    logits: torch.Tensor, token_ids: torch.Tensor, kappa: float, temperature: float
) -> torch.Tensor:
    """The definition (docs/architecture.md, "Lp-Reg, exactly") in probability space, float64, one full
    softmax: keep p ≥ κ·max p, renormalize."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    kept = p >= kappa * p.amax(dim=-1, keepdim=True)
    proxy = p * kept / (p * kept).sum(dim=-1, keepdim=True)
    return proxy.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1).log().float()


def test_logits_hand_case() -> None:
    # p = [0.6, 0.39, 0.01], κ = 0.02 → threshold 0.012: token 2 is filtered, kept mass 0.99.
    # proxy(0) = log(0.6 / 0.99) = −0.500775, proxy(1) = log(0.39 / 0.99) = −0.931558, proxy(2) = −inf.
    logits = torch.tensor([0.6, 0.39, 0.01]).log().expand(1, 3, 3)
    proxy = proxy_logp_from_logits(logits, torch.tensor([[0, 1, 2]]))
    assert_close(proxy, torch.tensor([[math.log(0.6 / 0.99), math.log(0.39 / 0.99), -INF]]))


def test_logits_apply_the_sampling_temperature() -> None:
    # logits [2, 1, 0] at temperature 2 → p ∝ [e, e^0.5, 1]. κ = 0.5 → threshold e/2 = 1.359: keeps 0, 1.
    # proxy(1) = log(e^0.5 / (e + e^0.5)) = 0.5 − log(e + e^0.5) = −0.974077.
    logits = torch.tensor([[[2.0, 1.0, 0.0]]])
    proxy = proxy_logp_from_logits(logits, torch.tensor([[1]]), kappa=0.5, temperature=2.0)
    assert_close(proxy, torch.tensor([[0.5 - math.log(math.e + math.e**0.5)]]))
    # At temperature 1 the same token is filtered: p ∝ [e², e, 1], threshold e²/2 = 3.69 > e.
    assert proxy_logp_from_logits(logits, torch.tensor([[1]]), kappa=0.5).isneginf().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 3, 256])
def test_logits_match_naive_full_softmax(dtype: torch.dtype, chunk_rows: int) -> None:
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 5, 200
    logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
    # half the sampled tokens from the head of the distribution, half uniform (mostly filtered)
    head = logits.float().topk(4, dim=-1).indices[..., 0]
    token_ids = torch.where(torch.rand(B, T, generator=g) < 0.5, head, torch.randint(V, (B, T), generator=g))
    proxy = proxy_logp_from_logits(logits, token_ids, kappa=0.02, temperature=0.7, chunk_rows=chunk_rows)
    expected = _naive_proxy(logits.float(), token_ids, kappa=0.02, temperature=0.7)
    assert proxy.dtype == torch.float32
    assert proxy.isneginf().any() and proxy.isfinite().any()  # the case covers both outcomes
    assert_close(proxy, expected, atol=1e-5, rtol=1e-5)


def test_logits_requiring_grad_are_fine_and_give_no_grad() -> None:
    logits = torch.randn(2, 3, 10, requires_grad=True)
    proxy = proxy_logp_from_logits(logits, torch.zeros(2, 3, dtype=torch.long))
    assert not proxy.requires_grad
    assert_close(proxy, _naive_proxy(logits.detach(), torch.zeros(2, 3, dtype=torch.long), 0.02, 1.0))


def test_logits_validate_arguments() -> None:
    with pytest.raises(ValueError, match="kappa"):
        proxy_logp_from_logits(torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.long), kappa=1.5)
    with pytest.raises(ValueError, match="token_ids"):
        proxy_logp_from_logits(torch.zeros(1, 2, 4), torch.zeros(1, 3, dtype=torch.long))


def test_topk_hand_case() -> None:
    # Full p = [0.6, 0.39, 0.005, 0.005], K = 3, κ = 0.02 → threshold 0.012.
    # kept in top-k = {0, 1}; k-th (3rd) p = 0.005 < 0.012 → exact. Normalizer 0.99.
    # Sampled 1 → log(0.39/0.99); sampled 2 (in top-k, filtered) → −inf; sampled 3 (not in top-k) → −inf.
    topk_logp = torch.tensor([0.6, 0.39, 0.005]).log().expand(1, 3, 3)
    topk_ids = torch.tensor([0, 1, 2]).expand(1, 3, 3)
    proxy, exact = proxy_logp_from_topk(torch.tensor([[1, 2, 3]]), topk_ids, topk_logp)
    assert_close(proxy, torch.tensor([[math.log(0.39 / 0.99), -INF, -INF]]))
    assert exact.all()


def test_topk_inexact_when_kth_prob_is_above_threshold() -> None:
    # p = [0.3, 0.3, 0.2, 0.2], K = 2: the 2nd p = 0.3 ≥ κ·0.3 → the kept set may extend past k: not exact.
    # Proxy from the top-2 alone: log(0.3 / 0.6) = log 0.5 (the true one is log 0.3).
    topk_logp = torch.tensor([[[0.3, 0.3]]]).log()
    proxy, exact = proxy_logp_from_topk(torch.tensor([[0]]), torch.tensor([[[0, 1]]]), topk_logp)
    assert_close(proxy, torch.tensor([[math.log(0.5)]]))
    assert not exact.any()


def _topk_of(logits: torch.Tensor, K: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits / temperature, dim=-1)
    topk_logp, topk_ids = logp.topk(K, dim=-1)
    return topk_ids, topk_logp


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    T=st.integers(1, 6),
    V=st.integers(2, 80),
    K=st.integers(1, 20),
    scale=st.floats(0.1, 8.0),
    temperature=st.floats(0.3, 2.0),
    kappa=st.sampled_from([0.005, 0.02, 0.1, 0.5]),
)
def test_topk_equals_logits_wherever_exact(
    seed: int, T: int, V: int, K: int, scale: float, temperature: float, kappa: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    K = min(K, V)
    logits = torch.randn(2, T, V, generator=g) * scale
    topk_ids, topk_logp = _topk_of(logits, K, temperature)
    # sampled tokens: a mix of top-k members and arbitrary vocabulary ids
    pick = torch.randint(K, (2, T, 1), generator=g)
    token_ids = torch.where(
        torch.rand(2, T, generator=g) < 0.6,
        topk_ids.gather(-1, pick).squeeze(-1),
        torch.randint(V, (2, T), generator=g),
    )
    from_topk, exact = proxy_logp_from_topk(token_ids, topk_ids, topk_logp, kappa=kappa)
    from_logits = proxy_logp_from_logits(logits, token_ids, kappa=kappa, temperature=temperature)
    assert_close(from_topk[exact], from_logits[exact], atol=1e-5, rtol=1e-5)
    if K == V:  # the whole vocabulary is in the top-k: right everywhere, even where not flagged exact
        assert_close(from_topk, from_logits, atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 6))
def test_topk_inexact_error_is_bounded_by_missing_mass(seed: int, K: int) -> None:
    # Where not exact, a token kept inside the top-k gets log p − log Z_k ≥ the true log p − log Z;
    # the excess is log(Z / Z_k) ≤ log(1 + missing / Z_k), missing = 1 − Σ top-k p.
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 8, 40, generator=g) * 0.5  # flat: the kept set often extends past the top-k
    topk_ids, topk_logp = _topk_of(logits, K, 1.0)
    token_ids = topk_ids[..., 0]
    from_topk, exact = proxy_logp_from_topk(token_ids, topk_ids, topk_logp)
    true = proxy_logp_from_logits(logits, token_ids)
    kept_k = topk_logp >= topk_logp[..., :1] + math.log(0.02)
    z_k = (topk_logp.exp() * kept_k).sum(-1)
    missing = 1 - topk_logp.exp().sum(-1)
    excess = from_topk - true
    assert (excess >= -1e-5).all()
    assert (excess[~exact] <= torch.log1p(missing / z_k)[~exact] + 1e-5).all()
