"""A checkpoint that cannot be written (issue 20): one clear line (path, errno, free space), training goes
on journaling, the next checkpoint retries, and the journal is never trimmed past a checkpoint that was
written; only the final checkpoint's failure ends the run, non-zero, naming the fix; `ended.json` always
says why. Real DeepSpeed, the real stack (`sparkrl up`'s launcher, private redis-server, HTTP).

The checkpoints folder is made unwritable in a way that holds for root too (which ignores permission
bits): a plain file where the folder should be, so every write under it fails with ENOTDIR.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from _faults import assert_exactly_once, settings, steps_done, wait
from _live import Live
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import start_stack

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.run_report import summarize
from sparkrl.services.common.modeling import load_model, load_tokenizer
from sparkrl.services.common.settings import load_settings
from sparkrl.services.learner.checkpoint import (
    CheckpointError,
    TrainState,
    latest_checkpoint,
    save_checkpoint,
)
from sparkrl.services.learner.ledger import Journal
from sparkrl.services.learner.trainer import build_engine, init_distributed

PER_STEP = 4
FAILED = "could not be written: [ENOTDIR] Not a directory"


def block(run_dir: Path) -> Path | None:
    """Put a file where RUN_DIR/checkpoints is; returns where its folder was moved (None: there was
    none), for `unblock`."""
    root = run_dir / "checkpoints"
    aside = None
    if root.is_dir():
        aside = run_dir / "checkpoints.aside"
        root.rename(aside)
    root.write_text("a file where the checkpoints folder should be\n")
    return aside


def unblock(run_dir: Path, aside: Path | None) -> None:
    root = run_dir / "checkpoints"
    root.unlink()
    if aside is not None:
        aside.rename(root)


def failures_logged(run_dir: Path) -> int:
    return (run_dir / "logs" / "learner.log").read_text(errors="replace").count(FAILED)


def test_a_failed_save_names_path_errno_and_free_space_and_leaves_latest(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    cfg = load_settings("smoke").learner
    init_distributed(cfg)
    engine, tokenizer = build_engine(load_model(tiny_model_dir), cfg), load_tokenizer(tiny_model_dir)
    first = save_checkpoint(engine, tokenizer, tmp_path, TrainState(step=1), keep=2)
    aside = block(tmp_path)
    with pytest.raises(CheckpointError) as failed:
        save_checkpoint(engine, tokenizer, tmp_path, TrainState(step=2), keep=2)
    path = tmp_path / "checkpoints" / "step-000002"
    assert failed.value.path == path and failed.value.errno == 20
    assert re.fullmatch(
        rf"checkpoint {re.escape(str(path))} {re.escape(FAILED)}( \(.+\))?; "
        r"[\d.]+ GiB free of [\d.]+ GiB on .+",
        str(failed.value),
    ), str(failed.value)
    unblock(tmp_path, aside)
    assert latest_checkpoint(tmp_path) == first  # the complete one is still the newest
    assert save_checkpoint(engine, tokenizer, tmp_path, TrainState(step=2), keep=2) == path


@pytest.mark.slow
def test_two_checkpoints_fail_training_goes_on_and_the_run_finishes_once_writable(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """Periodic checkpoints every 2 steps fail while training goes on; the journal keeps every step
    since the start; a checkpoint command is answered with the reason. Paused, the folder is given back;
    resumed, the run reaches its last step, and every group is trained exactly once."""
    steps = 16
    cfg = settings(
        tiny_model_dir,
        tmp_path / "run",
        f"learner.max_steps={steps}",
        f"learner.prompts_per_step={PER_STEP}",
        "learner.checkpoint_every=2",
        f"prompts.count={steps * PER_STEP}",
    )
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    aside = block(plan.run_dir)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    live = Live(plan, stack, plan.settings.control.url, plan.token_path.read_text().strip())
    wait("two checkpoints to fail", lambda: failures_logged(plan.run_dir) >= 2, plan.run_dir)
    assert live.send("POST", "/api/v1/pause", {"reason": "checkpoint folder"}).status_code == 200
    live.wait("the learner to pause", lambda: live.get("/api/v1/status")["state"] == "paused")
    done = steps_done(plan.run_dir)
    assert 4 <= done < steps, "the learner trained on past the failures"
    assert Journal(plan.run_dir).steps() == list(range(1, done + 1)), "trimmed past a checkpoint not written"

    asked = live.send("POST", "/api/v1/checkpoint", {"tag": "asked"})
    assert asked.status_code == 200 and asked.json()["outcome"] == "rejected", asked.text
    assert FAILED in asked.json()["results"][0]["detail"]
    learner_metrics = plan.settings.learner.metrics
    scraped = httpx.get(f"http://{learner_metrics.host}:{learner_metrics.port}/metrics", timeout=10).text
    failures = re.search(r"^sparkrl_learner_checkpoint_failures_total (\S+)$", scraped, re.M)
    assert failures is not None and float(failures[1]) >= 3

    unblock(plan.run_dir, aside)
    assert live.send("POST", "/api/v1/resume", {}).status_code == 200
    learner = stack.procs["learner"]
    wait("the learner to finish", lambda: learner.poll() is not None, plan.run_dir, timeout_s=300)
    assert learner.returncode == 0
    assert_exactly_once(plan, steps)
    # The final checkpoint (16) holds every step; the journal keeps those since the one before it (14).
    assert Journal(plan.run_dir).steps() == [15, 16]
    assert (
        json.loads((plan.run_dir / "ended.json").read_text())["reason"]
        == f"learner.max_steps ({steps}) reached"
    )
    line = next(ln for ln in (plan.run_dir / "logs" / "learner.log").read_text().splitlines() if FAILED in ln)
    assert "GiB free" in line and "training goes on: the journal keeps the 2 steps since step 0" in line


@pytest.mark.slow
def test_the_final_checkpoint_failing_ends_non_zero_naming_the_fix_and_loses_nothing(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """No checkpoint can be written all run: the learner exits non-zero at its last step, `ended.json`
    and the summary say why and what to do; the journal holds every step, so once the folder is
    writable a resumed learner replays them and the run ends with every group trained exactly once."""
    steps = 3
    cfg = settings(
        tiny_model_dir,
        tmp_path / "run",
        f"learner.max_steps={steps}",
        f"learner.prompts_per_step={PER_STEP}",
        "learner.checkpoint_every=100",
        f"prompts.count={steps * PER_STEP}",
    )
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    aside = block(plan.run_dir)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    learner = stack.procs["learner"]
    wait("the learner to stop", lambda: learner.poll() is not None, plan.run_dir)
    assert learner.returncode == 1
    reason = json.loads((plan.run_dir / "ended.json").read_text())["reason"]
    assert reason.startswith(
        f"learner.max_steps ({steps}) reached; then the final checkpoint (step {steps}) "
    )
    assert FAILED in reason and "Fix: make RUN_DIR/checkpoints a writable directory" in reason
    assert f"ended: {reason}" in summarize(plan.run_dir)
    assert Journal(plan.run_dir).steps() == [1, 2, 3]

    unblock(plan.run_dir, aside)
    again = plan_stack(plan.settings.model_copy(deep=True), workers=2, private_redis=False, resume=True)
    resumed = start_stack(stacks, Stack(again, services=["learner"], ready_timeout_s=180))
    wait("the resumed learner", lambda: resumed.procs["learner"].poll() is not None, plan.run_dir)
    assert resumed.procs["learner"].returncode == 0
    assert_exactly_once(plan, steps)
    assert "replaying step 1 from the journal" in (plan.run_dir / "logs" / "learner.log").read_text()
