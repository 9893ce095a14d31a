"""Every port a setting names is checked before anything starts (issue 23, item 6): a busy one is refused
by the preflight, naming the setting and the process that holds it; ports left at 0 or their default are
picked free by the plan, as before."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env, free_port

from sparkrl import ports
from sparkrl.plan import plan_stack
from sparkrl.preflight import check
from sparkrl.services.common.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]
# A server of another program: binds the port it is given and listens until killed.
LISTENER = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
    "print('listening', flush=True); time.sleep(600)\n"
)


@pytest.fixture
def busy_port() -> Iterator[tuple[int, int]]:
    """(port, pid) of another process listening on a port of 127.0.0.1."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", LISTENER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
        yield port, proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_only_the_ports_a_setting_names_are_checked_and_the_plan_keeps_exactly_those(tmp_path: Path) -> None:
    assert ports.given_ports(load_settings(None, [])) == []  # defaults: the plan picks them all
    given = {
        "control.port": 18201,
        "reward.port": 18101,
        "sync.port": 29611,
        "sync.http_port": 29612,
        "learner.metrics.port": 19001,
        "rollout.metrics.port": 19002,
    }
    cfg = load_settings(None, [f"run_dir={tmp_path}", *(f"{k}={v}" for k, v in given.items())])
    assert {(b.setting, b.port) for b in ports.given_ports(cfg)} == set(given.items())
    planned = plan_stack(cfg, workers=1).settings
    kept = {
        "control.port": planned.control.port,
        "reward.port": planned.reward.port,
        "sync.port": planned.sync.port,
        "sync.http_port": planned.sync.http_port,
        "learner.metrics.port": planned.learner.metrics.port,
    }
    assert kept == {k: v for k, v in given.items() if k in kept}  # what is checked is what is bound
    zeros = load_settings(None, [f"run_dir={tmp_path}", "control.port=0", "sync.http_port=0"])
    assert ports.given_ports(zeros) == []  # 0: any free port, chosen by the plan


def test_a_busy_port_names_its_setting_and_its_holder(busy_port: tuple[int, int]) -> None:
    port, pid = busy_port
    cfg = load_settings(None, [f"control.port={port}"])
    (problem,) = ports.problems(cfg)
    setting, message = problem
    assert setting == "control.port"
    assert (
        f"port {port} on 127.0.0.1 is taken by pid {pid} (" in message
        and "set another control.port" in message
    )
    # A port named twice is a problem even while it is free: the second service could not bind it.
    free = free_port()
    assert ports.problems(load_settings(None, [f"reward.port={free}"])) == []
    twice = ports.problems(load_settings(None, [f"reward.port={free}", f"control.port={free}"]))
    assert twice == [("reward.port", f"port {free} is control.port too: give each its own")]


def test_the_preflight_refuses_a_busy_port(tiny_model_dir: Path, busy_port: tuple[int, int]) -> None:  # noqa: F811
    port, _ = busy_port
    problems = check(load_settings("smoke", [f"model={tiny_model_dir}", f"sync.port={port}"]))
    assert [p.setting for p in problems] == ["sync.port"]


def test_up_refuses_a_busy_control_port_before_anything_starts(
    tiny_model_dir: Path,  # noqa: F811
    busy_port: tuple[int, int],
    tmp_path: Path,
) -> None:
    port, pid = busy_port
    run_dir = tmp_path / "run"
    command = ["up", "--preset", "smoke", "--run-dir", str(run_dir), "--set", f"model={tiny_model_dir}"]
    done = subprocess.run(
        [sys.executable, "-m", "sparkrl.cli", *command, "--set", f"control.port={port}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=clean_env(),
    )
    assert done.returncode == 2, done.stderr
    assert f"error: control.port: port {port} on 127.0.0.1 is taken by pid {pid}" in done.stderr
    assert "nothing was started" in done.stderr
    assert "live page" not in done.stdout  # the header (another server's URL as ours) never printed
    assert not run_dir.exists()  # no config, no log, no lock left behind
