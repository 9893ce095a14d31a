"""The `sparkrl` entry point as a user runs it: a real subprocess per command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _tiny import tiny_model_dir  # noqa: F401  (fixture)


def _sparkrl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKRL_")}
    return subprocess.run(
        [sys.executable, "-m", "sparkrl.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_every_service_has_a_command() -> None:
    out = _sparkrl("--help")
    assert out.returncode == 0, out.stderr
    for command in ("up", "learner", "rollout", "reward", "prompts", "build-tiny-model"):
        assert command in out.stdout


def test_build_tiny_model_reuses_the_cache(tiny_model_dir: Path) -> None:  # noqa: F811
    out = _sparkrl("build-tiny-model", "--out", str(tiny_model_dir.parent))
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip().splitlines()[-1]) == tiny_model_dir


def test_a_bad_setting_is_refused_before_anything_starts() -> None:
    out = _sparkrl("learner", "--set", "learner.loss.name=lp-reg")
    assert out.returncode != 0
    assert "learner.loss" in out.stderr and "lp_reg" in out.stderr
    out = _sparkrl("rollout", "--preset", "no-such-preset")
    assert out.returncode != 0 and "known presets" in out.stderr
