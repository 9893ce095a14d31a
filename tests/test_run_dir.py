"""One run per directory: `sparkrl up` refuses a directory holding an earlier run (before anything is
spawned) unless it resumes it or is told to overwrite it; and a learner that finds versions it cannot
rebuild retires them under numbers its own weights never carry."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparkrl.plan import earlier_run, prepare_run_dir
from sparkrl.services.learner.checkpoint import TrainState
from sparkrl.services.learner.ledger import retire_lost_versions


def _earlier(run_dir: Path) -> None:
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')


def test_a_second_run_in_the_same_directory_is_refused_resumed_or_overwritten(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    prepare_run_dir(run_dir, resume=False, overwrite=False)  # nothing there: fine
    _earlier(run_dir)
    with pytest.raises(ValueError, match=r"--resume.*--overwrite"):
        prepare_run_dir(run_dir, resume=False, overwrite=False)
    prepare_run_dir(run_dir, resume=True, overwrite=False)  # continuing it is what --resume is for
    assert earlier_run(run_dir) == ["metrics.jsonl", "checkpoints"]
    prepare_run_dir(run_dir, resume=False, overwrite=True)
    assert list(run_dir.iterdir()) == []  # emptied (a live run's lock, held by `up`, would stay)


def _said(done: subprocess.CompletedProcess[str]) -> str:
    """The error without the terminal box it is drawn in (which wraps its lines)."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", done.stderr).split())


def test_the_command_says_what_to_do_and_spawns_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _earlier(run_dir)
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--preset", "smoke", "--run-dir", str(run_dir)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "holds an earlier run" in _said(done)
    assert not (run_dir / "logs").exists() and not (run_dir / "config").exists()
    both = subprocess.run([*command, "--resume", "--overwrite"], capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "pick one" in _said(both)


def test_retired_versions_never_include_the_one_the_learner_announces() -> None:
    state = TrainState(policy_version=50)
    retire_lost_versions(state, announced=200)  # 51..200 were announced by weights now lost
    assert state.void_versions == [[51, 200]]
    assert state.policy_version == 201  # the weights in hand go out as 201: their groups are trained
    assert not any(lo <= state.policy_version <= hi for lo, hi in state.void_versions)
    unchanged = TrainState(policy_version=7)
    retire_lost_versions(unchanged, announced=7)
    assert unchanged.void_versions == [] and unchanged.policy_version == 7


def test_auto_resume_goes_on_from_a_checkpoint_or_a_journal_and_starts_fresh_otherwise(
    tmp_path: Path,
) -> None:
    """`sparkrl learner --auto-resume` (compose, Kubernetes): an empty run directory is a fresh run; one with
    a checkpoint, or journaled steps that no checkpoint holds yet (a crash before the first), is resumed."""
    from sparkrl.services.learner.ledger import Journal
    from sparkrl.services.learner.service import run_state

    run_dir = tmp_path / "run"
    assert run_state(run_dir) is None
    Journal(run_dir).path(1).write_bytes(b"")  # a step journaled before any checkpoint
    assert run_state(run_dir) == "1 journaled steps, no checkpoint yet"
    step = run_dir / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    (run_dir / "checkpoints" / "latest").write_text("step-000002")
    assert run_state(run_dir) == f"checkpoint {step}"
