"""The losses called as the hand-checked tests read them: tensors by name, hyperparameters as keywords
(validated by the loss's own settings class, so a test cannot pass a value the settings would refuse).
The product calls `policy_loss(inputs, cfg.loss)`; these adapters build the `cfg`."""

from __future__ import annotations

from typing import Any

from torch import Generator, Tensor

from sparkrl.services.common.losses import LOSSES, LossInputs, policy_loss
from sparkrl.services.common.losses.clip_cov import ClipCovLoss
from sparkrl.services.common.losses.clip_cov import clip_cov_loss as _clip_cov
from sparkrl.services.common.losses.clip_higher import ClipHigherLoss
from sparkrl.services.common.losses.clip_higher import clip_higher_loss as _clip_higher
from sparkrl.services.common.losses.eighty_twenty import EightyTwentyLoss
from sparkrl.services.common.losses.eighty_twenty import eighty_twenty_loss as _eighty_twenty
from sparkrl.services.common.losses.entropy_bonus import EntropyBonusLoss
from sparkrl.services.common.losses.entropy_bonus import entropy_bonus_loss as _entropy_bonus
from sparkrl.services.common.losses.gspo import GspoLoss
from sparkrl.services.common.losses.gspo import gspo_loss as _gspo
from sparkrl.services.common.losses.kl_cov import KlCovLoss
from sparkrl.services.common.losses.kl_cov import kl_cov_loss as _kl_cov
from sparkrl.services.common.losses.lp_reg import LpRegLoss
from sparkrl.services.common.losses.lp_reg import lp_reg_loss as _lp_reg
from sparkrl.services.common.losses.ppo_clip import PpoClipLoss
from sparkrl.services.common.losses.ppo_clip import ppo_clip_loss as _ppo_clip

Out = tuple[Tensor, dict[str, Tensor]]


def lp_reg_loss(
    logp: Tensor, old_logp: Tensor, proxy_logp: Tensor, advantages: Tensor, mask: Tensor,
    *, token_weights: Tensor | None = None, **hparams: Any,
) -> Out:  # fmt: skip
    cfg = LpRegLoss(**hparams)
    return _lp_reg(logp, old_logp, advantages, mask, cfg, proxy_logp=proxy_logp, token_weights=token_weights)


def ppo_clip_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
    *, token_weights: Tensor | None = None, **hparams: Any,
) -> Out:  # fmt: skip
    return _ppo_clip(logp, old_logp, advantages, mask, PpoClipLoss(**hparams), token_weights=token_weights)


def clip_higher_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
    *, token_weights: Tensor | None = None, **hparams: Any,
) -> Out:  # fmt: skip
    cfg = ClipHigherLoss(**hparams)
    return _clip_higher(logp, old_logp, advantages, mask, cfg, token_weights=token_weights)


def entropy_bonus_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, entropy: Tensor,
    *, token_weights: Tensor | None = None, **hparams: Any,
) -> Out:  # fmt: skip
    cfg = EntropyBonusLoss(**hparams)
    return _entropy_bonus(logp, old_logp, advantages, mask, cfg, entropy=entropy, token_weights=token_weights)


def eighty_twenty_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, entropy: Tensor,
    *, token_weights: Tensor | None = None, **hparams: Any,
) -> Out:  # fmt: skip
    cfg = EightyTwentyLoss(**hparams)
    return _eighty_twenty(logp, old_logp, advantages, mask, cfg, entropy=entropy, token_weights=token_weights)


def kl_cov_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
    *, token_weights: Tensor | None = None, **hparams: Any,
) -> Out:  # fmt: skip
    return _kl_cov(logp, old_logp, advantages, mask, KlCovLoss(**hparams), token_weights=token_weights)


def clip_cov_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
    *, token_weights: Tensor | None = None, generator: Generator | None = None, **hparams: Any,
) -> Out:  # fmt: skip
    cfg = ClipCovLoss(**hparams)
    return _clip_cov(logp, old_logp, advantages, mask, cfg, token_weights=token_weights, generator=generator)


def gspo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
    *, token_weights: Tensor | None = None, **hparams: Any,
) -> Out:  # fmt: skip
    return _gspo(logp, old_logp, advantages, mask, GspoLoss(**hparams), token_weights=token_weights)


def loss_by_name(name: str, inputs: LossInputs, **hparams: Any) -> Out:
    """The product's path: the loss registered as `name`, its settings from `hparams` over its defaults."""
    return policy_loss(inputs, LOSSES[name].settings(name=name, **hparams))
