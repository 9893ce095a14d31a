"""The `sparkrl` entry point as a user runs it: a real subprocess per command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env


def _sparkrl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    return subprocess.run(
        [sys.executable, "-m", "sparkrl.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_every_service_has_a_command() -> None:
    out = _sparkrl("--help")
    assert out.returncode == 0, out.stderr
    commands = ("up", "learner", "rollout", "reward", "prompts", "control", "build-tiny-model", "report")
    for command in (*commands, "status", "pause", "resume", "stop", "checkpoint", "set"):
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


def test_the_control_clients_say_what_is_wrong(tmp_path: Path) -> None:
    out = _sparkrl("status", "--url", "http://127.0.0.1:1")
    assert out.returncode == 1 and "cannot reach the control service at http://127.0.0.1:1" in out.stderr
    assert out.stderr.startswith("control API http://127.0.0.1:1\n")  # it says where it connects
    out = _sparkrl("set", "lr", "--url", "http://127.0.0.1:1")
    assert out.returncode != 0 and "not name=value" in out.stderr
    out = _sparkrl("pause", "--run-dir", str(tmp_path))
    assert out.returncode == 1 and f"is {tmp_path} a run directory written by `sparkrl up`?" in out.stderr
    out = _sparkrl("report", str(tmp_path))
    assert out.returncode == 1 and "metrics.jsonl" in out.stderr
    out = _sparkrl("control")
    assert out.returncode != 0 and "SPARKRL_CONTROL__TOKEN" in out.stderr


def test_status_prints_what_is_not_known_yet_as_the_report_does() -> None:
    from sparkrl.client import format_status
    from sparkrl.run_files import MISSING

    status = {"state": "starting", "step": 0, "max_steps": 40, "policy_version": 0, "paused": False}
    status |= {"generation_tokens_per_s": 0.0, "hyperparameters": {}, "sampling": {"temperature": 1.0}}
    worker = {"worker_id": "worker-0", "state": "loading", "policy_version": None, "lag": None}
    worker |= {"sync_failures": 0, "heartbeat_age_s": 0.5, "tokens_per_s": 0.0, "prompts_in_flight": 0}
    lines = format_status(status, {"workers": [worker]}).splitlines()
    said = f"learner starting | step 0/40 | version 0 | loss {MISSING} | reward {MISSING}"
    assert lines[0].startswith(said)
    assert lines[1] == f"hyperparameters: {MISSING}" and lines[2] == "sampling: temperature=1.0"
    unknown = [MISSING] * 4  # version, lag, sync seconds and MB: none yet
    assert lines[4].split() == ["worker-0", "loading", *unknown, "0", "0.5", "0", "0"]
