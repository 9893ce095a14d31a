"""The losses room: every policy loss, one file each — its settings class and its function.

A loss file holds a settings class (a `LossSection` naming the loss in `name: Literal["…"]`, every
hyperparameter with its default, bounds and description) and a pure function registered on it:

    @register_loss(CispoLoss, zero_advantage_free=True)
    def cispo_loss(logp, old_logp, advantages, mask, cfg: CispoLoss, *, token_weights=None): ...

Everything else is derived: the file is found here (every module of this folder but the shared pieces,
`_SHARED`), its settings class becomes a variant of `learner.loss` (so presets, `--set`, the settings
reference and the live checks of the control service know it), and the learner reads what it needs and
allows from the registry (the optional inputs its signature names; whether A = 0 completions may be
skipped). docs/architecture.md ("Adding a loss") walks through one.

Who uses it: the learner (the functions), the settings tree and the control service (the settings
classes: they never load torch, see `ops.py`).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Annotated, Union

from pydantic import Field

from sparkrl.services.common.losses.registry import (
    LOSSES,
    LossInputs,
    LossSpec,
    loss_spec,
    policy_loss,
    register_loss,
    settings_classes,
)
from sparkrl.services.common.losses.section import LossSection

# This room's shared pieces (`mismatch`: the importance weights every loss takes); the rest are losses.
_SHARED = ("ops", "registry", "section", "mismatch")
# Lp-Reg first (the default, and first in the settings reference), then by name.
for _module in sorted((m.name for m in pkgutil.iter_modules(__path__)), key=lambda n: (n != "lp_reg", n)):
    if _module not in _SHARED:
        importlib.import_module(f"{__name__}.{_module}")

# The settings of `learner.loss`: one variant per loss, chosen by `name`.
LossSettings = Annotated[Union[tuple(settings_classes())], Field(discriminator="name")]  # noqa: UP007

from sparkrl.services.common.losses.lp_reg import LpRegLoss  # noqa: E402  (after discovery: the default)

__all__ = [
    "LOSSES",
    "LossInputs",
    "LossSection",
    "LossSettings",
    "LossSpec",
    "LpRegLoss",
    "loss_spec",
    "policy_loss",
    "register_loss",
]
