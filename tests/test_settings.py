"""The settings tree: every preset loads, sources stack in order, typos fail at load time."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from sparkrl.services.common.settings import CONFIGS_DIR, load_settings, parse_override, write_resolved

PRESETS = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def test_the_three_presets_exist() -> None:
    assert {"demo", "smoke", "paper"} <= set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_loads_and_round_trips(preset: str, tmp_path: Path) -> None:
    settings = load_settings(preset)
    resolved = write_resolved(settings, tmp_path / "resolved.yaml")
    assert load_settings(str(resolved)) == settings


def test_paper_preset_is_the_papers_recipe() -> None:
    learner = load_settings("paper").learner
    assert learner.loss.name == "lp_reg"
    assert (learner.loss.rho, learner.loss.beta, learner.loss.clip_low, learner.loss.clip_high) == (
        0.01,
        1.0,
        1.0,
        9.0,
    )
    assert (learner.lr, learner.grad_clip, learner.proxy_kappa, learner.prompts_per_step) == (
        1e-6,
        1.0,
        0.02,
        256,
    )


def test_sources_stack_defaults_preset_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().rollout.sampling.n == 8  # default
    assert load_settings("smoke").rollout.sampling.n == 4  # preset beats default
    monkeypatch.setenv("SPARKRL_ROLLOUT__SAMPLING__N", "6")
    assert load_settings("smoke").rollout.sampling.n == 6  # environment beats preset
    assert load_settings("smoke", ["rollout.sampling.n=3"]).rollout.sampling.n == 3  # --set beats all


def test_switching_variant_drops_the_old_variants_fields() -> None:
    # The demo preset sets lp_reg's rho and beta; a baseline chosen on the command line must still load.
    settings = load_settings("demo", ["learner.loss.name=ppo_clip", "learner.loss.clip_high=0.3"])
    assert settings.learner.loss.name == "ppo_clip"
    assert settings.learner.loss.clip_high == 0.3


def test_variants_are_chosen_by_name() -> None:
    settings = load_settings(overrides=["learner.loss.name=clip_higher", "rollout.engine.kind=vllm"])
    assert settings.learner.loss.clip_high == 0.28
    assert settings.rollout.engine.gpu_memory_utilization == 0.85


@pytest.mark.parametrize(
    "override",
    [
        "rollout.samplng.n=4",
        "learner.loss.name=lp-reg",
        "rollout.sampling.temperature=0",
        "learner.zero_stage=5",
    ],
)
def test_typos_and_out_of_bounds_fail_at_load(override: str) -> None:
    with pytest.raises(ValidationError):
        load_settings(overrides=[override])


def test_bad_override_and_unknown_preset_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"key\.path=value"):
        parse_override("no-equals-sign")
    with pytest.raises(FileNotFoundError, match="known presets"):
        load_settings("no-such-preset")


def test_a_list_of_text_is_parsed_as_yaml_and_text_is_taken_as_written() -> None:
    assert parse_override('rollout.sampling.stop=["</answer>", "\\n\\n"]') == (
        ["rollout", "sampling", "stop"],
        ["</answer>", "\n\n"],
    )
    settings = load_settings(overrides=['rollout.sampling.stop=["</answer>"]'])
    assert settings.rollout.sampling.stop == ["</answer>"]
    assert parse_override("prompts.template={prompt}: a, b")[1] == "{prompt}: a, b"
