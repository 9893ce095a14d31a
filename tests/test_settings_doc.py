"""The settings described from their models: docs/settings.md's reference is current, `sparkrl config show`
is the resolved tree (valid YAML, every leaf described), `sparkrl --version`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from sparkrl import __version__
from sparkrl.services.common.settings import SparkSettings, load_settings
from sparkrl.settings_doc import DOC, fields, with_reference


def test_the_settings_reference_is_current() -> None:
    text = DOC.read_text()
    assert with_reference(text) == text, "run `python -m sparkrl.settings_doc --write`"
    paths = [path for path, *_ in fields(SparkSettings)]
    for path in ("learner.schedule.kind", "learner.kl.coef", "eval.every", "prompts.countdown.min_count",
                 "learner.loss[lp_reg].rho", "rollout.engine[vllm].gpu_memory_utilization"):  # fmt: skip
        assert path in paths and f"`{path}`" in text


def test_config_show_is_the_resolved_tree_with_descriptions() -> None:
    command = [sys.executable, "-m", "sparkrl.cli", "config", "show", "--preset", "demo"]
    done = subprocess.run([*command, "--set", "learner.lr=0.01"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    shown = yaml.safe_load(done.stdout)
    expected = load_settings("demo", ["learner.lr=0.01"]).model_dump(mode="json")
    assert shown == expected and shown["learner"]["lr"] == 0.01
    assert "lr: 0.01  # Learning rate" in done.stdout
    version = subprocess.run(
        [sys.executable, "-m", "sparkrl.cli", "--version"], capture_output=True, text=True
    )
    assert version.stdout.strip() == f"sparkrl {__version__}"


def test_config_show_describes_the_chosen_variant() -> None:
    """Two losses describe a field of the same name differently: the comment is the chosen loss's."""
    from sparkrl.settings_doc import annotated_yaml

    grpo = annotated_yaml(load_settings("demo", ["learner.loss.name=grpo"]))
    gspo = annotated_yaml(load_settings("demo", ["learner.loss.name=gspo"]))
    assert "clip_low: 0.2  # ε_low.\n" in grpo and "sequence ratio" not in grpo
    assert "# ε_low on the sequence ratio." in gspo
    assert "device: cpu  # torch device" in grpo  # rollout.engine's variant, chosen by `kind`


def test_a_misspelt_setting_gets_a_did_you_mean() -> None:
    from pydantic import ValidationError

    from sparkrl.services.common.settings import describe_settings_error

    def said(override: str) -> str:
        with pytest.raises(ValidationError) as raised:
            load_settings("demo", [override])
        return describe_settings_error(raised.value)

    assert "learner.lrr: Extra inputs are not permitted (got 1); did you mean learner.lr?" in said(
        "learner.lrr=1"
    )
    assert "did you mean rollout.sampling.temperature?" in said("rollout.sampling.temprature=1")
    assert "did you mean learner.loss.rho?" in said("learner.loss.rhoo=0.1")  # inside the chosen loss
    assert "did you mean" not in said("learner.zzz=1")  # nothing close: no guess
