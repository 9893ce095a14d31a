"""Live hyperparameters: names, bounds taken from the settings models, all-or-nothing application."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sparkrl.proto import HyperparameterPatch
from sparkrl.services.common.settings import LearnerSettings, SamplingSettings, hparams
from sparkrl.services.common.settings.hparams import HparamError, apply_learner, apply_sampling, check


def test_the_patch_model_names_exactly_the_live_hyperparameters() -> None:
    assert set(HyperparameterPatch.model_fields) == set(hparams.ALL_NAMES)
    assert HyperparameterPatch(lr=1e-5, temperature=0.9).values() == {"lr": 1e-5, "temperature": 0.9}
    with pytest.raises(ValueError, match="at least one"):
        HyperparameterPatch()
    with pytest.raises(ValueError):
        HyperparameterPatch(lr=float("inf"))
    with pytest.raises(ValueError):
        HyperparameterPatch.model_validate({"learning_rate": 1e-5})


def test_in_force_lists_the_active_loss_and_its_parameters() -> None:
    cfg = LearnerSettings()
    values = hparams.learner_hparams(cfg)
    assert values == {
        "lr": 1e-6,
        "max_staleness": 4,
        "kappa": 0.02,
        "loss": "lp_reg",
        "rho": 0.01,
        "rho_pos": 0.0,
        "beta": 1.0,
        "clip_low": 1.0,
        "clip_high": 9.0,
    }
    grpo = LearnerSettings.model_validate({"loss": {"name": "grpo"}})
    assert hparams.learner_hparams(grpo)["loss"] == "grpo" and "beta" not in hparams.learner_hparams(grpo)


def test_bounds_come_from_the_settings_models_with_their_reasons() -> None:
    problems = {p.name: p for p in check({"lr": 0, "beta": -1, "rho": 2, "max_staleness": 1.5}, "lp_reg")}
    assert problems["lr"].msg.startswith("lr must be ≥ 1e-10: Adam moves each weight by about lr per step")
    assert problems["beta"].msg == "beta must be ≥ 0: a negative weight would reward what the term penalizes"
    assert problems["rho"].msg == "rho must be ≤ 1: it is a fraction of the tokens"
    assert problems["max_staleness"].type == "int_from_float"  # not a bound: pydantic's own message
    assert problems["beta"].as_error() == {
        "type": "greater_than_equal",
        "loc": ["body", "beta"],
        "msg": "beta must be ≥ 0: a negative weight would reward what the term penalizes",
        "input": -1,
    }
    assert check({"temperature": 0}, None)[0].msg.startswith("temperature must be ≥ 0.01: below it")
    assert check({"lr": 3e-4, "beta": 0.5, "temperature": 0.9, "top_p": 0.95}, "lp_reg") == []


def test_the_value_that_destroyed_a_run_is_refused_with_the_reason() -> None:
    [lr] = check({"lr": 1e9}, "lp_reg")
    assert lr.type == "less_than_equal"
    assert lr.msg.startswith("lr must be ≤ 0.1: Adam moves every weight by about lr per step")
    assert check({"lr": 0.1}, "lp_reg") == []  # the bound itself is allowed


@pytest.mark.parametrize("loss_name", sorted(hparams.LOSS_CLASSES))
def test_every_live_hyperparameter_has_bounds_with_reasons(loss_name: str) -> None:
    """Each live number has a lower and an upper bound, and every bound says why it is there."""
    owners = [(LearnerSettings, field) for field in hparams.LEARNER_FIELDS.values()]
    owners += [(SamplingSettings, name) for name in hparams.SAMPLING_FIELDS]
    owners += [(hparams.LOSS_CLASSES[loss_name], name) for name in hparams.loss_fields(loss_name)]
    for model, field in owners:
        info = model.model_fields[field]
        bounds = {
            type(m).__name__.lower(): m for m in info.metadata if type(m).__name__ in ("Gt", "Ge", "Lt", "Le")
        }
        assert bounds.keys() & {"gt", "ge"} and bounds.keys() & {"lt", "le"}, f"{model.__name__}.{field}"
        reasons = (info.json_schema_extra or {}).get("why", {})  # type: ignore[union-attr]
        assert set(bounds) <= set(reasons), f"{model.__name__}.{field}: a bound without its reason"


def test_every_preset_fits_the_bounds() -> None:
    from sparkrl.services.common.settings import CONFIGS_DIR, load_settings

    for preset in sorted(CONFIGS_DIR.glob("*.yaml")):
        load_settings(str(preset))  # raises on a value out of bounds (deploy files: test_deploy_*.py)


def test_names_must_exist_and_belong_to_the_active_loss() -> None:
    [unknown] = check({"learning_rate": 1.0}, "lp_reg")
    assert unknown.type == "unknown" and "known: lr" in unknown.msg
    [foreign] = check({"entropy_coef": 0.01}, "lp_reg")
    assert foreign.type == "not_a_loss_parameter" and "(its parameters: rho, rho_pos, beta" in foreign.msg
    assert check({"entropy_coef": 0.01}, "entropy_bonus") == []
    assert check({"entropy_coef": 0.01}, None) == []  # loss unknown: some loss has it
    [kind] = check({"lr": True}, None)
    assert kind.type == "number_type"  # not 1.0: pydantic's lax mode would take a bool


def test_apply_is_all_or_nothing_and_returns_new_settings() -> None:
    cfg = LearnerSettings(prompts_per_step=16)
    with pytest.raises(HparamError, match="beta"):
        apply_learner(cfg, {"lr": 1e-3, "beta": -1})
    new, applied = apply_learner(cfg, {"lr": 1e-3, "beta": 0.5, "kappa": 0.05, "temperature": 0.5})
    assert applied == {"lr": 1e-3, "beta": 0.5, "kappa": 0.05}  # the worker's value is not the learner's
    assert (new.lr, new.loss.beta, new.proxy_kappa, new.prompts_per_step) == (1e-3, 0.5, 0.05, 16)
    assert (cfg.lr, cfg.loss.beta, cfg.proxy_kappa) == (1e-6, 1.0, 0.02)  # the old value never changes
    assert new.model_fields_set == cfg.model_fields_set | {"lr", "proxy_kappa", "loss"}
    assert apply_learner(new, {"max_staleness": 2})[0].lr == 1e-3  # a change keeps the earlier ones
    sampling = SamplingSettings()
    with pytest.raises(HparamError, match="top_p"):
        apply_sampling(sampling, {"temperature": 0.9, "top_p": 1.5})
    cooler, applied = apply_sampling(sampling, {"temperature": 0.7, "lr": 1.0})
    assert applied == {"temperature": 0.7} and cooler.temperature == 0.7 and sampling.temperature == 1.0


def test_settings_are_frozen() -> None:
    """Live values are replaced, never assigned: whoever holds the old settings keeps them whole."""
    cfg, sampling = LearnerSettings(), SamplingSettings()
    for model, field, value in ((cfg, "lr", 1e-3), (cfg.loss, "beta", 0.5), (sampling, "top_p", 0.5)):
        with pytest.raises(ValidationError, match="frozen"):
            setattr(model, field, value)
