"""Live hyperparameters: their names, where they live in the settings tree, and the checks every change
passes before anything is applied.

Names are flat (`lr`, `beta`, `temperature`), as `PATCH /api/v1/hyperparameters` and `sparkrl set` take
them. Each maps to one settings field, and a value is checked by building that settings model with it, so
the bounds are the models' own (`LearnerSettings.lr ≤ 0.1`, `LpRegLoss.beta ≥ 0`, ...) and cannot drift:
the control service checks (422 naming the field, the bound and why it is there: each bounded field
gives its reasons in `json_schema_extra["why"]`, keyed by the constraint), and the learner and the
workers check again before they apply (all or nothing).

Settings are frozen: applying values returns new settings (`apply_learner`, `apply_sampling`), which the
learner's loop and the worker's control put in place of the old ones between steps and batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from sparkrl.proto import HparamValue
from sparkrl.services.common.losses import LOSSES
from sparkrl.services.common.settings import LearnerSettings, SamplingSettings

# Learner hyperparameter name → its LearnerSettings field.
LEARNER_FIELDS: dict[str, str] = {"lr": "lr", "max_staleness": "max_staleness", "kappa": "proxy_kappa"}
# Worker hyperparameters: SamplingSettings fields of the same name.
SAMPLING_FIELDS: tuple[str, ...] = ("temperature", "top_p")


# loss name → its settings class (`grpo` and `ppo_clip` share one)
LOSS_CLASSES: dict[str, type[BaseModel]] = {name: spec.settings for name, spec in LOSSES.items()}


def loss_fields(loss_name: str) -> tuple[str, ...]:
    """The live-changeable parameters of one loss (every field but `name`)."""
    return tuple(f for f in LOSS_CLASSES[loss_name].model_fields if f != "name")


ALL_LOSS_FIELDS: tuple[str, ...] = tuple(sorted({f for name in LOSS_CLASSES for f in loss_fields(name)}))
ALL_NAMES: tuple[str, ...] = (*LEARNER_FIELDS, *ALL_LOSS_FIELDS, *SAMPLING_FIELDS)


@dataclass(frozen=True)
class Problem:
    """One rejected value, shaped like a pydantic error so an API can answer it as a 422 entry."""

    name: str
    msg: str
    type: str
    input: Any

    def as_error(self, loc_prefix: tuple[str, ...] = ("body",)) -> dict[str, Any]:
        return {"type": self.type, "loc": [*loc_prefix, self.name], "msg": self.msg, "input": self.input}


class HparamError(ValueError):
    """Some values were rejected; nothing was applied."""

    problems: list[Problem]

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(f"{p.name}: {p.msg}" for p in problems))
        self.problems = problems


def learner_hparams(cfg: LearnerSettings) -> dict[str, HparamValue]:
    """What the learner has in force: its own fields, the loss's name and parameters."""
    values: dict[str, HparamValue] = {name: getattr(cfg, field) for name, field in LEARNER_FIELDS.items()}
    values["loss"] = cfg.loss.name
    values |= {name: getattr(cfg.loss, name) for name in loss_fields(cfg.loss.name)}
    return values


def split(values: dict[str, HparamValue]) -> tuple[dict[str, HparamValue], dict[str, HparamValue]]:
    """(the learner's values, the workers' values)."""
    workers = {k: v for k, v in values.items() if k in SAMPLING_FIELDS}
    return {k: v for k, v in values.items() if k not in SAMPLING_FIELDS}, workers


BOUND_SIGNS = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}  # pydantic's constraint names


def bound_message(model: type[BaseModel], field: str, name: str, error: ErrorDetails) -> str:
    """`lr must be ≤ 0.1: <why>` for a broken bound that gives its reason; else pydantic's message."""
    ctx = error.get("ctx") or {}
    extra = model.model_fields[field].json_schema_extra
    reasons = extra.get("why") if isinstance(extra, dict) else None
    for constraint, sign in BOUND_SIGNS.items():
        if constraint in ctx and isinstance(reasons, dict) and constraint in reasons:
            limit = ctx[constraint]
            shown = f"{limit:g}" if isinstance(limit, int | float) else str(limit)
            return f"{name} must be {sign} {shown}: {reasons[constraint]}"
    return str(error["msg"])


def _assign_problem(model: type[BaseModel], field: str, name: str, value: Any) -> Problem | None:
    try:
        model.model_validate({field: value})  # the field's own type and bounds (the rest: defaults)
    except ValidationError as exc:
        error = exc.errors()[0]
        return Problem(name, bound_message(model, field, name, error), str(error["type"]), value)
    return None


def check(values: dict[str, HparamValue], loss_name: str | None) -> list[Problem]:
    """Every problem with `values` for a learner running `loss_name` (None: not known, so a loss
    parameter must fit some loss that has it)."""
    problems = []
    for name, value in values.items():
        problem = _check_one(name, value, loss_name)
        if problem is not None:
            problems.append(problem)
    return problems


def _check_one(name: str, value: HparamValue, loss_name: str | None) -> Problem | None:
    if name not in ALL_NAMES:
        return Problem(
            name, f"unknown hyperparameter {name!r}; known: {', '.join(ALL_NAMES)}", "unknown", value
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        # pydantic's lax mode would take `true` as 1.0; every live hyperparameter is a number.
        return Problem(name, f"Input should be a number, not {type(value).__name__}", "number_type", value)
    if name in LEARNER_FIELDS:
        return _assign_problem(LearnerSettings, LEARNER_FIELDS[name], name, value)
    if name in SAMPLING_FIELDS:
        return _assign_problem(SamplingSettings, name, name, value)
    if loss_name is not None and name not in loss_fields(loss_name):
        known = ", ".join(loss_fields(loss_name)) or "none"
        msg = f"{name!r} is not a parameter of the active loss {loss_name!r} (its parameters: {known})"
        return Problem(name, msg, "not_a_loss_parameter", value)
    owner = next(LOSS_CLASSES[n] for n in LOSS_CLASSES if loss_name in (None, n) and name in loss_fields(n))
    return _assign_problem(owner, name, name, value)


def apply_learner(
    cfg: LearnerSettings, values: dict[str, HparamValue]
) -> tuple[LearnerSettings, dict[str, HparamValue]]:
    """`cfg` with the learner's values (all or nothing; worker names are ignored): (the new settings, what
    is now in force for those names). `cfg` itself never changes: settings are frozen, a live change is a
    new value. Raises HparamError if any is rejected."""
    mine, _ = split(values)
    problems = check(mine, cfg.loss.name)
    if problems:
        raise HparamError(problems)
    own = {LEARNER_FIELDS[name]: value for name, value in mine.items() if name in LEARNER_FIELDS}
    loss = {name: value for name, value in mine.items() if name not in LEARNER_FIELDS}
    new = replaced(cfg, own | {"loss": replaced(cfg.loss, loss)})
    in_force = learner_hparams(new)
    return new, {name: in_force[name] for name in mine}


def apply_sampling(
    cfg: SamplingSettings, values: dict[str, HparamValue]
) -> tuple[SamplingSettings, dict[str, HparamValue]]:
    """`cfg` with the workers' values (all or nothing; learner names are ignored): (the new settings, what
    is now in force for those names). Raises HparamError."""
    _, mine = split(values)
    problems = check(mine, None)
    if problems:
        raise HparamError(problems)
    new = replaced(cfg, mine)
    return new, {name: getattr(new, name) for name in mine}


M = TypeVar("M", bound=BaseModel)


def replaced(model: M, values: dict[str, Any]) -> M:
    """A copy of `model` with `values`, validated as a new one is (types coerced, validators run): the
    fields it was built with are kept as they are, the rest keep their defaults."""
    kept = {name: getattr(model, name) for name in model.model_fields_set}
    return type(model).model_validate(kept | values)
