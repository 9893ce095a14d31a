"""`sparkrl up` keeps every service alive: what an exit means (`supervision.py`), real processes restarted
within a budget, the end reason when one cannot be kept alive, the workers' bounded wait on the reward
service, and `kill -9` of the reward service in a real run that still trains every group exactly once."""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from _faults import assert_exactly_once, kill9, settings, steps_done, wait
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import free_port, start_stack

from sparkrl.launcher import Role, ServiceSpec, Stack, StackPlan, plan_stack, write_configs
from sparkrl.proto import RewardItem
from sparkrl.proto.run_files import EXIT_UNFIT
from sparkrl.services.common.reward_client import RewardClient, RewardServiceError
from sparkrl.services.common.settings import SparkSettings, SupervisionSettings
from sparkrl.supervision import Restarts, on_exit

STEPS, PER_STEP = 8, 4
_SLEEP = "import time; time.sleep(60)"


def spec(tmp_path: Path, name: str, role: Role, code: str = _SLEEP) -> ServiceSpec:
    config = tmp_path / "config" / f"{name}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("{}\n")
    command = (sys.executable, "-c", code)
    return ServiceSpec(name, role, command, config, SparkSettings(), tmp_path / "logs" / f"{name}.log")


def fake_plan(tmp_path: Path, services: list[ServiceSpec], max_restarts: int) -> StackPlan:
    """A plan of small Python programs (nothing listens on port 1: no Redis is touched)."""
    root = SparkSettings(
        run_dir=str(tmp_path),
        bus={"url": "redis://127.0.0.1:1/0"},
        supervision={"max_restarts": max_restarts, "restart_window_s": 600},
    )
    return StackPlan(tmp_path, root, tuple(services), False)


# ── what an exit means ────────────────────────────────────────────────────────────────────────────────


def test_each_exit_is_a_restart_an_end_or_nothing(tmp_path: Path) -> None:
    restarts = Restarts(SupervisionSettings(max_restarts=2, restart_window_s=60))
    reward, feeder = spec(tmp_path, "reward", "reward"), spec(tmp_path, "prompts", "prompts")
    worker, evaluator = spec(tmp_path, "worker-0", "rollout"), spec(tmp_path, "evaluator", "evaluator")
    learner = spec(tmp_path, "learner", "learner")

    assert (
        on_exit(learner, 0, restarts, 0.0, 1).action == "end"
        and on_exit(learner, 0, restarts, 0, 1).code == 0
    )
    assert on_exit(learner, -9, restarts, 0.0, 1).code == 137  # as a shell reports a signal death
    assert on_exit(feeder, 0, restarts, 0.0, 1).action == "go on"  # it fed everything: not a death
    assert on_exit(worker, 0, restarts, 0.0, 1).message == "worker-0 stopped"  # a stop command
    assert restarts.times == {}

    first = on_exit(reward, -9, restarts, 0.0, 1)
    assert first.action == "restart" and "reward exited with code -9; restarting it (1 of at most 2" in (
        first.message or ""
    )
    assert on_exit(reward, -9, restarts, 1.0, 1).action == "restart"
    third = on_exit(reward, -9, restarts, 2.0, 1)
    assert (third.action, third.code) == ("end", 1) and "cannot be kept alive" in (third.reason or "")
    assert on_exit(reward, 1, restarts, 70.0, 1).action == "restart"  # the window moved on: budget again

    for _ in range(2):
        assert on_exit(worker, 3, restarts, 0.0, 1).action == "restart"
    assert on_exit(worker, 3, restarts, 0.0, 1).action == "go on"  # given up: another worker is left
    for _ in range(2):
        assert on_exit(evaluator, 1, restarts, 0.0, 0).action == "restart"
    assert "training goes on without evaluation" in (on_exit(evaluator, 1, restarts, 0.0, 0).message or "")


def test_a_service_whose_set_up_is_wrong_ends_the_run_at_once(tmp_path: Path) -> None:
    """Exit code 78 (a worker whose engine cannot take the learner's tensors) is never restarted, even
    with the restart budget untouched and other workers left: they run the same model."""
    restarts = Restarts(SupervisionSettings(max_restarts=5, restart_window_s=60))
    worker = spec(tmp_path, "worker-0", "rollout")
    worker.log_path.parent.mkdir(parents=True, exist_ok=True)
    worker.log_path.write_text("ERROR the learner's weights do not fit: Gemma2ForCausalLM has no lm_head\n")
    outcome = on_exit(worker, EXIT_UNFIT, restarts, 0.0, 3)
    assert (outcome.action, outcome.code) == ("end", 1)
    assert "set-up is wrong, not restarted" in (outcome.message or "")
    assert "Gemma2ForCausalLM has no lm_head" in (outcome.message or "")  # the cause, from its log
    assert restarts.times == {}


# ── real processes ────────────────────────────────────────────────────────────────────────────────────


def test_a_killed_service_is_restarted_and_the_run_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    starts = tmp_path / "reward-starts"
    # The "reward service" SIGKILLs itself on its first start, and stays up on the second; the learner
    # finishes once it sees that second start. The feeder exits 0 (done): not restarted.
    reward = (
        f"import os, signal, time; p = {str(starts)!r}; open(p, 'a').write('x');"
        "n = len(open(p).read()); n == 1 and os.kill(os.getpid(), signal.SIGKILL); time.sleep(60)"
    )
    learner = (
        f"import os, time\np = {str(starts)!r}\n"
        "while not os.path.exists(p) or len(open(p).read()) < 2:\n    time.sleep(0.05)"
    )
    services = [
        spec(tmp_path, "reward", "reward", reward),
        spec(tmp_path, "learner", "learner", learner),
        spec(tmp_path, "prompts", "prompts", "print('fed')"),
    ]
    stack = Stack(fake_plan(tmp_path, services, max_restarts=3), grace_s=5)
    try:
        stack.start()
        assert stack.wait(poll_s=0.05) == 0
    finally:
        stack.shutdown()
    err = capsys.readouterr().err
    assert f"warning: reward exited with code {-signal.SIGKILL}; restarting it (1 of at most 3" in err
    assert "learner finished" in err
    assert len(stack.restarts.times["reward"]) == 1 and "prompts" not in stack.restarts.times
    assert (
        "--- sparkrl up: exited with code -9; restarted ---" in (tmp_path / "logs" / "reward.log").read_text()
    )
    assert not (tmp_path / "ended.json").exists()  # the learner ended the run: its own reason stands


def test_a_service_that_cannot_be_kept_alive_ends_the_run_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The learner writes its own end reason when stopped, as the real one does.
    learner = (
        "import json, signal, sys, time\n"
        "def stop(*_):\n"
        f"    open({str(tmp_path / 'ended.json')!r}, 'w').write(json.dumps({{'reason': 'stopped (signal)', "
        "'step': 3}))\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "time.sleep(60)\n"
    )
    services = [
        spec(tmp_path, "control", "control", "import sys; print('bad config'); sys.exit(3)"),
        spec(tmp_path, "learner", "learner", learner),
    ]
    stack = Stack(fake_plan(tmp_path, services, max_restarts=2), grace_s=5)
    try:
        stack.start()
        assert stack.wait(poll_s=0.05) == 1
    finally:
        stack.shutdown()
    err = capsys.readouterr().err
    assert err.count("warning: control exited with code 3; restarting it") == 2
    assert "error: control exited with code 3, after 2 restarts within 600s" in err and "bad config" in err
    ended = json.loads((tmp_path / "ended.json").read_text())
    assert ended["reason"].startswith("control exited with code 3, after 2 restarts")
    assert "cannot be kept alive" in ended["reason"]
    assert (ended["learner_reason"], ended["step"]) == ("stopped (signal)", 3)


def test_a_reward_call_gives_up_at_its_deadline_naming_it() -> None:
    client = RewardClient(f"http://127.0.0.1:{free_port()}", retries=100, backoff_s=0.05, deadline_s=1.0)
    item = RewardItem(task="countdown", completion="1+2", answer="3")
    try:
        with pytest.raises(RewardServiceError, match=r"deadline 1s.*cannot reach"):
            client.score([item])
    finally:
        client.close()


def test_a_stopping_worker_does_not_retry_a_failed_reward_call(caplog: pytest.LogCaptureFixture) -> None:
    """Told to stop while the reward service is down, the worker's scoring call gives up at once instead of
    retrying up to its deadline (120 s by default, past the launcher's grace): the batch's prompts are left
    to be reclaimed. A stop set during a retry's pause ends the pause too."""
    item = RewardItem(task="countdown", completion="1+2", answer="3")
    stop = threading.Event()
    stop.set()
    client = RewardClient(f"http://127.0.0.1:{free_port()}", retries=100, deadline_s=600.0, stop=stop)
    try:
        with pytest.raises(RewardServiceError, match=r"stopping, so not retrying: cannot reach"):
            client.score([item])
        assert "retrying in" not in caplog.text  # it says it gives up, not that it will retry
        stop.clear()
        client.backoff_s = client.backoff_max_s = 600.0  # a pause far longer than the test would wait
        client.deadline_s = None
        failed: list[BaseException] = []
        caller = threading.Thread(target=lambda: _record(failed, client.score, [item]))
        caller.start()
        caller.join(timeout=1.0)
        assert caller.is_alive(), "the call gave up before the stop"
        stop.set()
        caller.join(timeout=30)  # a hang reads as the 600 s pause; the bound is not a timing
        assert not caller.is_alive() and "stopping" in str(failed[0])
    finally:
        client.close()


def _record(failed: list[BaseException], call: Callable[..., object], *args: object) -> None:
    try:
        call(*args)
    except RewardServiceError as exc:
        failed.append(exc)


# ── the real stack ────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.slow
def test_the_reward_service_killed_mid_run_is_restarted_and_every_group_trains_once(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = settings(
        tiny_model_dir,
        tmp_path / "run",
        f"learner.max_steps={STEPS}",
        f"learner.prompts_per_step={PER_STEP}",
        "learner.checkpoint_every=4",
        f"prompts.count={STEPS * PER_STEP}",
    )
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    wait("step 2", lambda: steps_done(plan.run_dir) >= 2, plan.run_dir)
    kill9(stack, "reward")  # the workers are scoring all the time: some call is cut off or refused
    # The launcher's supervision loop (what `sparkrl up` runs) restarts it; the workers' calls retry.
    wait("the learner to finish", lambda: stack.poll() is not None, plan.run_dir, timeout_s=300)
    assert stack.procs["learner"].returncode == 0
    assert len(stack.restarts.times["reward"]) == 1
    assert all(stack.procs[name].poll() is None for name in ("worker-0", "worker-1", "reward"))
    assert "warning: reward exited with code -9; restarting it (1 of at most" in capsys.readouterr().err
    assert_exactly_once(plan, STEPS)
    assert json.loads((plan.run_dir / "ended.json").read_text())["reason"].startswith("learner.max_steps")
