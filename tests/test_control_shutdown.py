"""The control service never answers 500 because it or the run is stopping: a command in flight when the
service gets SIGTERM is answered 503 with what was sent; PATCHes racing a run's stop get 200 or 409. The
service is the real `sparkrl control` process on a private redis-server; the run is a real stack."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from _faults import settings, steps_done, wait
from _live import Live
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env, free_port, start_stack

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.proto import LearnerStatus
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import BusSettings
from sparkrl.services.common.telemetry import Telemetry

TOKEN = "shutdown-test-token"


def _busy_learner() -> LearnerStatus:
    """A live learner in the middle of a long step: it answers commands only at its next boundary."""
    return LearnerStatus(
        step=3,
        policy_version=3,
        state="training",
        groups_trained=12,
        group_epoch=1,
        hyperparameters={"loss": "lp_reg", "lr": 1e-4},
        heartbeat_at=time.time(),
    )


def test_commands_in_flight_when_the_service_stops_are_answered_503(
    bus_settings: BusSettings, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = clean_env() | {
        "SPARKRL_BUS__URL": bus_settings.url,
        "SPARKRL_BUS__NAMESPACE": bus_settings.namespace,
        "SPARKRL_CONTROL__TOKEN": TOKEN,
        "SPARKRL_CONTROL__PORT": str(port),
        "SPARKRL_CONTROL__COMMAND_TIMEOUT_S": "120",
    }
    log = (tmp_path / "control.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparkrl.cli", "control"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    answers: list[httpx.Response] = []
    beating = threading.Event()
    with RedisBus(bus_settings) as bus:
        telemetry = Telemetry(bus)

        def beat() -> None:  # the learner's heartbeat thread, mid-step: alive, not answering yet
            while not beating.wait(0.3):
                telemetry.put_learner(_busy_learner())

        telemetry.put_learner(_busy_learner())
        threading.Thread(target=beat, daemon=True).start()
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, (tmp_path / "control.log").read_text()
                time.sleep(0.2)
            headers = {"Authorization": f"Bearer {TOKEN}"}

            def patch(lr: float) -> None:
                body = {"lr": lr}
                answers.append(
                    httpx.patch(url + "/api/v1/hyperparameters", json=body, headers=headers, timeout=60)
                )

            threads = [threading.Thread(target=patch, args=(1e-5 * (i + 1),)) for i in range(4)]
            for thread in threads:
                thread.start()
            wait_until = time.monotonic() + 30
            while bus.logs.length("control") < len(threads):  # every command sent, every request waiting
                assert time.monotonic() < wait_until, (
                    f"the commands were never sent: {[a.text for a in answers]}"
                )
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            for thread in threads:
                thread.join(30)
            assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it shut down on
        finally:
            beating.set()
            if proc.poll() is None:
                proc.kill()
            log.close()
    assert len(answers) == 4
    for answer in answers:
        assert answer.status_code == 503, answer.text
        detail = answer.json()["detail"]
        assert "shutting down" in detail and "was sent" in detail and "learner" in detail, detail


@pytest.mark.slow
def test_patches_racing_a_stop_get_no_5xx(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """`POST /api/v1/stop` and PATCHes from several clients at once: each PATCH is applied before the stop
    (200) or refused because the learner stopped before it could apply it (409), never a 5xx."""
    cfg = settings(
        tiny_model_dir,
        tmp_path / "run",
        "learner.max_steps=1000",
        "prompts.count=4000",
        "control.command_timeout_s=60",
    )
    plan = plan_stack(cfg, workers=1, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    live = Live(plan, stack, plan.settings.control.url, plan.token_path.read_text().strip())
    wait("step 3", lambda: steps_done(plan.run_dir) >= 3, plan.run_dir)
    codes: list[int] = []

    def patch(i: int) -> None:
        for j in range(5):
            try:
                codes.append(
                    live.send("PATCH", "/api/v1/hyperparameters", {"lr": 1e-5 + 1e-7 * (i + j)}).status_code
                )
            except httpx.TransportError:  # the service itself went away with the run: not an answer
                return

    threads = [threading.Thread(target=patch, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    stop = live.send("POST", "/api/v1/stop")
    for thread in threads:
        thread.join(120)
    assert stop.status_code == 200, stop.text
    assert codes and set(codes) <= {200, 409}, codes
    learner = stack.procs["learner"]
    wait("the learner to stop", lambda: learner.poll() is not None, plan.run_dir)
    assert learner.returncode == 0
    assert os.path.exists(plan.run_dir / "ended.json")
