"""The whole loop, for real: private redis-server, reward service over HTTP, rollout worker processes, the
DeepSpeed learner on gloo, the feeder — started by the product's own launcher from resolved configs."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis as redis_lib
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import start_stack

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.proto import WeightAnnouncement, WorkerStatus
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.modeling import load_model
from sparkrl.services.common.settings import SparkSettings, load_settings
from sparkrl.services.common.weight_sync import weights_checksum

pytestmark = pytest.mark.slow


def _settings(model_dir: Path, run_dir: Path, *overrides: str) -> SparkSettings:
    return load_settings("smoke", [f"model={model_dir}", f"run_dir={run_dir}", *overrides])


def _wait(what: str, condition: Callable[[], bool], timeout_s: float, run_dir: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(
                f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                for log in sorted((run_dir / "logs").glob("*.log"))
            )
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{logs}")
        time.sleep(0.5)


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _trained_ids(run_dir: Path) -> list[str]:
    lines = (run_dir / "trained_groups.jsonl").read_text().splitlines()
    return [gid for line in lines for gid in json.loads(line)["group_ids"]]


def _statuses(bus: RedisBus) -> dict[str, WorkerStatus]:
    return {w: WorkerStatus.model_validate_json(raw) for w, raw in bus.statuses("worker").items()}


def test_the_loop_closes_workers_hold_the_learners_weights(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    steps, per_step = 3, 4
    cfg = _settings(
        tiny_model_dir,
        tmp_path / "run",
        f"learner.max_steps={steps}",
        f"learner.prompts_per_step={per_step}",
        "learner.max_staleness=1000",  # nothing dropped: every published group must be trained
        f"prompts.count={steps * per_step}",
    )
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan))
    learner = stack.procs["learner"]
    _wait("the learner to finish", lambda: learner.poll() is not None, 480, plan.run_dir)
    assert learner.returncode == 0

    rows = _metrics(plan.run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        metrics = r["metrics"]
        assert math.isfinite(metrics["loss/value"])
        # Entropy is measured over the tokens run: a step whose groups all scored alike runs none (A = 0
        # work skipped) and has no entropy; every other step has a finite one.
        ran = metrics["rollout/tokens"] - metrics["loss/skipped_tokens"]
        assert ("loss/entropy" in metrics) == (ran > 0), metrics
        assert ran == 0 or math.isfinite(metrics["loss/entropy"])
    expected = {
        "rollout/reward_mean",
        "loss/reg_tokens",
        "rollout/staleness_mean",
        "sync/seconds",
        "explore/sparks",
    }
    assert expected <= set(rows[-1]["metrics"]) and "worker_versions" in rows[-1]
    assert rows[-1]["hparams"]["loss"] == "lp_reg" and rows[-1]["hparams"]["lr"] == pytest.approx(1e-4)

    # Every fed prompt's group was trained exactly once, and nothing is left unacknowledged.
    trained = _trained_ids(plan.run_dir)
    assert len(trained) == len(set(trained)) == steps * per_step
    client = redis_lib.Redis.from_url(plan.settings.bus.url)
    bus = RedisBus(plan.settings.bus)
    assert client.xlen(bus.stream_key("trajectories")) == 0
    assert bus.pending_info("trajectories").pending == 0

    # The workers hold the final weights: their reported checksum is the announced one, which is the
    # checksum of the final checkpoint.
    announcement = WeightAnnouncement.model_validate_json(bus.get_value("weights"))
    assert announcement.version == steps

    def workers_synced() -> bool:
        statuses = _statuses(bus)
        return len(statuses) == 2 and all(
            s.weights_checksum == announcement.checksum for s in statuses.values()
        )

    _wait("both workers to report the final weights", workers_synced, 30, plan.run_dir)
    assert {s.policy_version for s in _statuses(bus).values()} == {steps}
    final = load_model(plan.run_dir / "checkpoints" / f"step-{steps:06d}" / "hf")
    assert weights_checksum(final.state_dict().items()) == announcement.checksum
    bus.close()


def test_a_worker_dies_another_joins_training_goes_on(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    steps = 8
    cfg = _settings(
        tiny_model_dir,
        tmp_path / "run",
        f"learner.max_steps={steps}",
        "sync.timeout_s=8",
        "prompts.count=400",
    )
    plan = plan_stack(cfg, workers=3, private_redis=True)
    write_configs(plan)
    stack = start_stack(
        stacks, Stack(plan, services=["redis", "reward", "learner", "worker-0", "worker-1", "prompts"])
    )
    _wait("two steps", lambda: len(_metrics(plan.run_dir)) >= 2, 180, plan.run_dir)

    os.kill(stack.procs["worker-1"].pid, signal.SIGKILL)
    newcomer = start_stack(stacks, Stack(plan, services=["worker-2"]))
    learner = stack.procs["learner"]
    _wait("the learner to finish", lambda: learner.poll() is not None, 480, plan.run_dir)
    assert learner.returncode == 0, "the learner must not hang or die when a worker does"
    assert [r["step"] for r in _metrics(plan.run_dir)][-1] == steps

    bus = RedisBus(plan.settings.bus)
    announcement = WeightAnnouncement.model_validate_json(bus.get_value("weights"))
    assert announcement.version == steps
    assert "worker-1" not in announcement.members

    def newcomer_current() -> bool:
        status = _statuses(bus).get("worker-2")
        return status is not None and status.policy_version == steps

    _wait("the newcomer to hold the current version", newcomer_current, 40, plan.run_dir)
    assert newcomer.procs["worker-2"].poll() is None
    bus.close()


def test_resume_continues_the_version_and_trains_no_group_twice(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    redis_url: str,
    stacks: list[Stack],
) -> None:
    run_dir = tmp_path / "run"
    # A shared, non-private Redis: the stream, acknowledgements and trained marks outlive the first run.
    common = ("learner.prompts_per_step=4", "learner.checkpoint_every=2", "learner.max_staleness=1000")
    first = _settings(tiny_model_dir, run_dir, f"bus.url={redis_url}", "learner.max_steps=2", *common)
    plan = plan_stack(first, workers=1, private_redis=False)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, services=["reward", "learner", "worker-0", "prompts"]))
    _wait("the first run", lambda: stack.procs["learner"].poll() is not None, 240, run_dir)
    stack.shutdown()
    assert os.readlink(run_dir / "checkpoints" / "latest") == "step-000002"
    # A model directory, as any Hugging Face tool loads one (a link, not a file naming the folder).
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "latest" / "hf") is not None
    first_ids = _trained_ids(run_dir)

    second = _settings(tiny_model_dir, run_dir, f"bus.url={redis_url}", "learner.max_steps=4", *common)
    plan = plan_stack(second, workers=1, private_redis=False, resume=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, services=["reward", "learner", "worker-0", "prompts"]))
    _wait("the resumed run", lambda: stack.procs["learner"].poll() is not None, 240, run_dir)
    assert stack.procs["learner"].returncode == 0

    rows = _metrics(run_dir)
    assert [(r["step"], r["policy_version"]) for r in rows] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    all_ids = _trained_ids(run_dir)
    assert all_ids[: len(first_ids)] == first_ids
    assert len(all_ids) == len(set(all_ids)) == 16, "a group was trained twice across the resume"
