"""Rollout/learner mismatch corrections (services/common/losses/mismatch.py) against hand-computed values:
token and sequence truncated IS, masked IS (IcePop) at the band's edges, their statistics, the settings'
refusals, and the weights reaching a loss's gradient."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from torch.testing import assert_close

from sparkrl.proto.testing import random_group
from sparkrl.services.common.losses import LossInputs, policy_loss
from sparkrl.services.common.losses.mismatch import Correction, correction_weights
from sparkrl.services.common.losses.ppo_clip import PpoClipLoss
from sparkrl.services.common.settings import LearnerSettings

L = math.log


def weights_and_stats(log_ratio: list[list[float]], mask: list[list[int]], correction: Correction):
    """The rollout's log-probs are 0, so the learner's are log ρ itself (float64: the edges exact)."""
    learner = torch.tensor(log_ratio, dtype=torch.float64)
    return correction_weights(learner, torch.zeros_like(learner), torch.tensor(mask), correction)


def test_token_truncated_is_by_hand() -> None:
    # ρ = [0.5, 3, 1.2] and a padded position whose log-probs are −inf (never a NaN).
    learner = torch.tensor([[L(0.5), L(3.0), L(1.2), -math.inf]])
    rollout = torch.tensor([[0.0, 0.0, 0.0, -math.inf]])
    w, stats = correction_weights(learner, rollout, torch.tensor([[1, 1, 1, 0]]), Correction(cap=2.0))
    assert w is not None and not w.requires_grad
    assert_close(w, torch.tensor([[0.5, 2.0, 1.2, 0.0]]))  # 3 is capped at 2
    assert stats["tis_capped_tokens"] == 1 and stats["is_capped_seqs"] == 1 and stats["is_seqs"] == 1
    assert stats["tis_weight_mean"] == pytest.approx((0.5 + 2.0 + 1.2) / 3)
    assert stats["is_capped_share"] == pytest.approx(1 / 3) and stats["is_masked_share"] == 0
    # KL(π_rollout ‖ π_learner) over the rollout's tokens: k1 = mean(−log ρ) = −log(0.5 · 3 · 1.2) / 3;
    # k3 = mean(ρ − 1 − log ρ) = (0.1931 + 0.9014 + 0.0177) / 3.
    assert stats["mismatch_kl"] == pytest.approx(-L(1.8) / 3, abs=1e-6)
    k3 = sum(r - 1 - L(r) for r in (0.5, 3.0, 1.2)) / 3
    assert stats["mismatch_k3"] == pytest.approx(k3, abs=1e-6)


def test_masked_is_at_the_band_edges() -> None:
    band = Correction(cap=None, mask="token", low=0.5, high=5.0)  # IcePop: M(ρ) = ρ in [0.5, 5], else 0
    # Exactly on either edge is inside; a hair outside (1e-6 relative) is masked.
    ratios = [0.5, 0.5 * (1 - 1e-6), 5.0, 5.0 * (1 + 1e-6), 1.0]
    w, stats = weights_and_stats([[L(r) for r in ratios]], [[1] * 5], band)
    assert w is not None
    assert_close(w, torch.tensor([[0.5, 0.0, 5.0, 0.0, 1.0]]))
    assert stats["is_masked_tokens"] == 2 and stats["is_masked_seqs"] == 1
    assert stats["is_masked_share"] == pytest.approx(2 / 5) and stats["tis_capped_tokens"] == 0
    # With a cap as well, a kept token keeps its truncated weight: min(5, 2) = 2, the masked stay 0.
    capped, stats = weights_and_stats([[L(r) for r in ratios]], [[1] * 5], Correction(2.0, "token", "token"))
    assert capped is not None
    assert_close(capped, torch.tensor([[0.5, 0.0, 2.0, 0.0, 1.0]]))
    assert stats["tis_capped_tokens"] == 1  # 5 → 2; the masked 5.000005 is not counted as capped
    # No lower end (α = 0): only the upper side masks, as TRL's token_mask does.
    w, _ = weights_and_stats([[L(1e-9), L(6.0)]], [[1, 1]], Correction(None, "token", "token", 0.0, 5.0))
    assert w is not None
    assert_close(w, torch.tensor([[1e-9, 0.0]]))


def test_sequence_level_truncation_and_mask_by_hand() -> None:
    # Row 0: ρ = [2, 2] (and padding) → the sequence's ρ = 4. Row 1: ρ = [0.5, 1.5, 1] → 0.75.
    log_ratio = [[L(2.0), L(2.0), 0.0], [L(0.5), L(1.5), 0.0]]
    mask = [[1, 1, 0], [1, 1, 1]]
    w, stats = weights_and_stats(log_ratio, mask, Correction(cap=2.0, level="sequence"))
    assert w is not None
    assert_close(w, torch.tensor([[2.0, 2.0, 0.0], [0.75, 0.75, 0.75]]))  # min(4, 2) on both of row 0
    assert stats["tis_capped_tokens"] == 2 and stats["is_capped_seqs"] == 1 and stats["is_seqs"] == 2
    # A sequence mask of [0.8, 5]: row 1 (0.75) is dropped whole; row 0 (4) keeps its token ratios.
    w, stats = weights_and_stats(log_ratio, mask, Correction(None, "token", "sequence", 0.8, 5.0))
    assert w is not None
    assert_close(w, torch.tensor([[2.0, 2.0, 0.0], [0.0, 0.0, 0.0]]))
    assert (stats["is_masked_tokens"], stats["is_masked_seqs"]) == (3, 1)
    assert stats["is_masked_share"] == pytest.approx(3 / 5)
    # Truncated by the sequence's ratio, masked by the token's: [0.6, 1.8] masks row 0's 2s and row 1's
    # 0.5; row 1's other tokens get min(0.75, 2) = 0.75.
    w, _ = weights_and_stats(log_ratio, mask, Correction(2.0, "sequence", "token", 0.6, 1.8))
    assert w is not None
    assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.75, 0.75]]))


def test_no_correction_measures_only_and_huge_ratios_stay_finite() -> None:
    w, stats = weights_and_stats([[L(2.0), 0.0]], [[1, 1]], Correction(cap=None))
    assert w is None and stats["is_seqs"] == 1 and stats["mismatch_kl"] == pytest.approx(-L(2.0) / 2)
    w, stats = weights_and_stats([[500.0, -500.0]], [[1, 1]], Correction(cap=2.0))
    assert w is not None
    assert_close(w, torch.tensor([[2.0, math.exp(-500.0)]]))
    assert all(math.isfinite(v) for v in stats.values())
    empty, stats = weights_and_stats([[0.0]], [[0]], Correction(2.0, "token", "token"))
    assert empty is not None and float(empty.sum()) == 0 and stats["is_seqs"] == 0  # no valid token


def test_a_masked_token_gets_no_gradient_and_stays_in_the_divisor() -> None:
    # GRPO at ratio 1 (logp = old_logp): loss_t = −A·w_t, token mean over all three tokens. Weights from
    # a token mask: token 1 (ρ = 3) leaves [0.5, 2] → w = [1, 0, 1]; A = [1, 1, −1].
    w, _ = weights_and_stats([[0.0, L(3.0), 0.0]], [[1, 1, 1]], Correction(None, "token", "token", 0.5, 2.0))
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    inputs = LossInputs(
        logp=logp,
        old_logp=logp.detach(),
        advantages=torch.tensor([[1.0, 1.0, -1.0]]),
        mask=torch.ones(1, 3, dtype=torch.bool),
        token_weights=w,
    )
    loss, _ = policy_loss(inputs, PpoClipLoss())
    assert_close(loss, torch.tensor((-1.0 + 0.0 + 1.0) / 3))  # the masked token still counts in the 3
    loss.backward()  # d loss / d logp_t = −A_t · w_t · r_t / 3, r = 1
    assert logp.grad is not None
    assert_close(logp.grad, torch.tensor([[-1 / 3, 0.0, 1 / 3]]))


def test_settings_refuse_what_cannot_combine() -> None:
    with pytest.raises(ValueError, match=r"learner\.is_mask token masks by π_learner/π_rollout.*recompute"):
        LearnerSettings(is_mask="token")
    with pytest.raises(ValueError, match=r"each row as one sequence.*pack_length"):
        LearnerSettings(old_logp_source="recompute", tis_level="sequence", pack_length=64)
    with pytest.raises(ValueError, match="each row as one sequence"):
        LearnerSettings(old_logp_source="recompute", is_mask="sequence", share_prompts=True)
    with pytest.raises(ValueError):
        LearnerSettings(is_mask_low=1.5)  # α ≤ 1 ≤ β
    ok = LearnerSettings(old_logp_source="recompute", is_mask="token", tis_level="sequence")
    assert (ok.is_mask_low, ok.is_mask_high) == (0.5, 5.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_an_update_reports_what_it_capped_and_masked(
    level: str,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A real update (DeepSpeed, the tiny model, π_old recomputed) on groups whose rollout log-probs are
    random: far from the model's, so the band masks some of them; the step row has the counts and shares."""
    from _learner import one_rank, settings

    from sparkrl.services.learner.ledger import Batch

    rng = np.random.default_rng(5)
    groups = [random_group(rng, n=4, T=6, k=4, vocab_size=259) for _ in range(3)]
    overrides = ["learner.old_logp_source=recompute", f"learner.is_mask={level}"]
    overrides += [f"learner.tis_level={level}"]
    trainer = one_rank(settings(tiny_model_dir, tmp_path, *overrides, "learner.skip_zero_advantage=false"))
    row = trainer.update(Batch(groups, []), 1, trainer.cfg).row()
    assert row["is_seqs"] == 12  # every completion ran (no A = 0 skipping here)
    assert 0 < row["is_masked_share"] <= 1 and math.isfinite(row["loss"])
    assert row["is_masked_seq_share"] == pytest.approx(row["is_masked_seqs"] / 12)
    assert row["mismatch_k3"] >= 0 and math.isfinite(row["mismatch_kl"])
    if level == "sequence":  # a whole sequence or none of it: the masked tokens are whole rows' of 6
        assert row["is_masked_tokens"] == 6 * row["is_masked_seqs"]
