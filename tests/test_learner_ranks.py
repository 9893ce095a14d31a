"""The data-parallel learner (`learner.ranks`): two real ranks under torchrun on gloo.

- On one fixed batch, two ranks (ZeRO-2, ZeRO-3) give the one-rank loss, gradient norm and every
  parameter after the step, to 1e-5 (tests/_dp_step.py is the step, run by torchrun or alone).
- The whole stack with `learner.ranks=2`: every group trained once, the workers on the final version.
- One rank SIGKILLed mid-run: the run stops saying so; `--resume` goes on with no group trained twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from _faults import assert_exactly_once, settings, steps_done, wait
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env, start_stack

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.proto import WeightAnnouncement, WorkerStatus
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.modeling import load_model

pytestmark = pytest.mark.slow

STEP_SCRIPT = Path(__file__).with_name("_dp_step.py")
ROOT = Path(__file__).resolve().parents[1]


def _one_step(model: Path, out: Path, zero: int, ranks: int) -> dict:
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    launcher = torchrun if ranks > 1 else []
    env = clean_env() | {"OMP_NUM_THREADS": "1"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    command = [sys.executable, *launcher, str(STEP_SCRIPT), "--model", str(model), "--out", str(out)]
    done = subprocess.run(
        [*command, "--zero", str(zero)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = torch.load(out)
    assert result["size"] == ranks
    return result


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:  # noqa: F811
    """The reference: the step on one rank (ZeRO-2; one rank's ZeRO stage changes nothing of the step)."""
    return _one_step(tiny_model_dir, tmp_path_factory.mktemp("one") / "one.pt", zero=2, ranks=1)


@pytest.mark.parametrize("zero", [2, 3])
def test_two_ranks_take_the_one_rank_step(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    one_rank: dict,
    zero: int,
) -> None:
    one = one_rank
    two = _one_step(tiny_model_dir, tmp_path / "two.pt", zero, ranks=2)
    for key in ("loss", "grad_norm", "tokens", "entropy", "proxy_inexact"):
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-7), key
    initial = load_model(tiny_model_dir).state_dict()
    assert one["weights"].keys() == two["weights"].keys() == initial.keys()
    moved = max(float((one["weights"][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 5e-5, "the step must move the weights by far more than the tolerance"
    for name, weight in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], weight, rtol=0, atol=1e-5, msg=name)


STEPS, PER_STEP = 6, 4


def _ranks_settings(model_dir: Path, run_dir: Path, *extra: str):
    return settings(
        model_dir,
        run_dir,
        "learner.ranks=2",
        "learner.zero_stage=2",
        "learner.threads=1",
        f"learner.max_steps={STEPS}",
        f"learner.prompts_per_step={PER_STEP}",
        "learner.checkpoint_every=2",
        f"prompts.count={STEPS * PER_STEP}",
        *extra,
    )


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_two_rank_learner_trains_every_group_once_and_the_workers_end_on_its_version(
    lora: bool,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """With every weight trained, and with a LoRA adapter (each version the adapter alone, its base's
    checksum announced by rank 0, merged by the worker)."""
    extra = ("learner.lora.r=8", "learner.lora.alpha=16", "learner.lr=1e-3") if lora else ()
    cfg = _ranks_settings(tiny_model_dir, tmp_path / "run", *extra)
    plan = plan_stack(cfg, workers=1, private_redis=True)
    write_configs(plan)
    learner = next(spec for spec in plan.services if spec.name == "learner")
    assert "torch.distributed.run" in learner.command and "--nproc-per-node=2" in learner.command
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    proc = stack.procs["learner"]
    wait("the two-rank learner to finish", lambda: proc.poll() is not None, plan.run_dir, timeout_s=400)
    log = (plan.run_dir / "logs" / "learner.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert "learner rank 0 of 2" in log and "learner rank 1 of 2 up" in log
    assert "rank 0 says the run is over" in log
    assert_exactly_once(plan, STEPS)
    with RedisBus(plan.settings.bus) as bus:
        announcement = WeightAnnouncement.model_validate_json(bus.get_value("weights"))
        assert announcement.version == STEPS
        assert (announcement.adapter_base is not None) == lora

        def synced() -> bool:
            statuses = [WorkerStatus.model_validate_json(raw) for raw in bus.statuses("worker").values()]
            return bool(statuses) and all(s.weights_checksum == announcement.checksum for s in statuses)

        wait("the worker to hold the final version", synced, plan.run_dir, timeout_s=60)


def _rank_pid(agent: psutil.Process, rank: int) -> int:
    for child in agent.children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "sparkrl.cli" in " ".join(child.cmdline()):
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no learner rank {rank} under torchrun {agent.pid}")


def test_a_killed_rank_stops_the_run_and_resume_trains_nothing_twice(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """SIGKILL rank 1: the run stops saying what to do. `--resume`, then stopped as `sparkrl up` stops a
    run: both ranks write the final checkpoint, they and torchrun exit 0. `--resume` again: to the end."""
    steps = 2 * STEPS
    cfg = _ranks_settings(tiny_model_dir, tmp_path / "run", f"learner.max_steps={steps}")
    cfg.prompts.count = steps * PER_STEP
    plan = plan_stack(cfg, workers=1, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    proc = stack.procs["learner"]
    wait("step 3", lambda: steps_done(plan.run_dir) >= 3, plan.run_dir, timeout_s=300)
    rank_1 = _rank_pid(psutil.Process(proc.pid), rank=1)
    at_kill = steps_done(plan.run_dir)  # the steps written when rank 1 dies (one may be in flight)
    os.kill(rank_1, signal.SIGKILL)
    wait("the learner to stop", lambda: proc.poll() is not None, plan.run_dir, timeout_s=120)
    log = (plan.run_dir / "logs" / "learner.log").read_text()
    assert proc.returncode != 0
    assert "failed on the learner's ranks" in log, log[-3000:]
    assert "`--resume` continues from the last one" in log
    killed_at = steps_done(plan.run_dir)
    # Counted from the kill, not from step 3: a learner that skips A = 0 work takes steps faster than the
    # wait above looks, and the step in flight (its row not yet written) may still end.
    assert killed_at <= at_kill + 2, "the run stopped where rank 1 died"

    # The same bus and worker; only the learner comes back, with --resume.
    again = plan_stack(plan.settings.model_copy(deep=True), workers=1, private_redis=False, resume=True)
    resumed = start_stack(stacks, Stack(again, services=["learner"], ready_timeout_s=180))
    proc = resumed.procs["learner"]
    wait("step 6", lambda: steps_done(plan.run_dir) >= 6, plan.run_dir, timeout_s=300)
    resumed.shutdown()  # as `sparkrl up` stops a run: SIGTERM to rank 0 (sparkrl/torchrun.py)
    log = (plan.run_dir / "logs" / "learner.log").read_text()
    stopped_at = steps_done(plan.run_dir)
    assert proc.returncode == 0 and stopped_at < steps, log[-3000:]
    assert log.count("rank 0 says the run is over") == 1  # the stopped run; the killed one never got there
    latest = os.readlink(plan.run_dir / "checkpoints" / "latest")
    assert latest == f"step-{stopped_at:06d}", "the final checkpoint holds every step taken"
    stacks.remove(resumed)

    again = plan_stack(plan.settings.model_copy(deep=True), workers=1, private_redis=False, resume=True)
    proc = start_stack(stacks, Stack(again, services=["learner"], ready_timeout_s=180)).procs["learner"]
    wait("the resumed learner to finish", lambda: proc.poll() is not None, plan.run_dir, timeout_s=400)
    assert proc.returncode == 0, (plan.run_dir / "logs" / "learner.log").read_text()[-3000:]
    assert_exactly_once(plan, steps)
