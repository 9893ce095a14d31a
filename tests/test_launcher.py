"""`sparkrl up`'s launcher: the plan and its written configs, progress and summary, real process control."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from sparkrl import launcher, processes
from sparkrl.launcher import (
    Role,
    ServiceSpec,
    Stack,
    StackPlan,
    plan_stack,
    run_stack,
    write_configs,
)
from sparkrl.proto import LearnerStatus, StepMetrics
from sparkrl.proto.run_files import DeadLetterRecord
from sparkrl.run_files import load_dead_letters
from sparkrl.run_report import progress_line, startup_line, summarize
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import SparkSettings, load_settings, write_resolved
from sparkrl.services.common.settings.roles import for_role
from sparkrl.services.common.telemetry import Telemetry


@pytest.fixture(autouse=True)
def _no_sparkrl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # load_settings lets SPARKRL_* override a file; these tests compare files with what was written.
    for key in [k for k in os.environ if k.startswith("SPARKRL_")]:
        monkeypatch.delenv(key)


def _group_members(pgid: int) -> list[int]:
    """Pids whose process group is `pgid` (from /proc), so a service's grandchildren are seen too."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped, not a zombie: the launcher waited for it
        assert _group_members(pid) == [], f"group {pid} left processes behind"


# ── plan and written configs ──────────────────────────────────────────────────────────────────────────


def test_plan_writes_one_config_per_service_that_loads_back(tmp_path: Path) -> None:
    cfg = load_settings(None, [f"run_dir={tmp_path / 'run'}", "learner.max_steps=7"])
    plan = plan_stack(cfg, workers=2)
    write_configs(plan)

    assert [s.name for s in plan.services] == [
        "redis",
        "control",
        "reward",
        "learner",
        "worker-0",
        "worker-1",
        "prompts",
    ]
    assert plan.private_redis  # no Redis URL given
    for spec in plan.services:
        assert spec.config_path.parent == tmp_path / "run" / "config"
        if spec.role == "redis":
            assert spec.config_path.read_text() == spec.config
            continue
        loaded = for_role(load_settings(str(spec.config_path)), spec.role)
        assert loaded == spec.config
        assert loaded.model_dump() == spec.config.model_dump()
    worker_1 = load_settings(str(tmp_path / "run" / "config" / "worker-1.yaml"))
    assert worker_1.rollout.worker_id == "worker-1"
    assert worker_1.run_dir == str(tmp_path / "run")
    assert load_settings(str(tmp_path / "run" / "config" / "learner.yaml")).learner.max_steps == 7


def test_plan_picks_free_ports_and_keeps_given_ones(tmp_path: Path) -> None:
    plan = plan_stack(SparkSettings(run_dir=str(tmp_path)), workers=2)
    auto = plan.settings
    redis_port = int(auto.bus.url.rsplit(":", 1)[1].split("/")[0])
    workers = [s.config.rollout.metrics.port for s in plan.services if s.role == "rollout"]
    ports = {
        redis_port,
        auto.reward.port,
        auto.sync.port,
        auto.control.port,
        auto.learner.metrics.port,
    }
    assert len(ports | set(workers)) == 7 and 0 not in workers
    assert 8100 not in (redis_port, auto.reward.port)  # defaults replaced, so two runs never collide
    assert 8200 != auto.control.port
    assert auto.reward.url == f"http://127.0.0.1:{auto.reward.port}"
    assert auto.control.url == f"http://127.0.0.1:{auto.control.port}"

    given = load_settings(
        None,
        [
            f"run_dir={tmp_path}",
            "bus.url=redis://10.0.0.5:6380/2",
            "reward.host=0.0.0.0",
            "reward.port=9123",
            "sync.port=29777",
        ],
    )
    plan = plan_stack(given, workers=1)
    assert not plan.private_redis and "redis" not in [s.name for s in plan.services]
    assert plan.settings.bus.url == "redis://10.0.0.5:6380/2"
    assert plan.settings.reward.url == "http://127.0.0.1:9123"  # clients call where the service binds
    assert plan.settings.sync.port == 29777
    private = plan_stack(given, workers=1, private_redis=True).settings.bus.url
    assert private.startswith("redis://:") and "@127.0.0.1:" in private  # its own password
    with pytest.raises(ValueError, match="at least 1"):
        plan_stack(given, workers=0)


def test_commands_start_each_service_from_its_file(tmp_path: Path) -> None:
    plan = plan_stack(SparkSettings(run_dir=str(tmp_path)), workers=2)
    by_name = {s.name: s for s in plan.services}
    config = tmp_path / "config"
    cli = (sys.executable, "-m", "sparkrl.cli")
    assert by_name["reward"].command == (*cli, "reward", "--preset", str(config / "reward.yaml"))
    assert by_name["control"].command == (*cli, "control", "--preset", str(config / "control.yaml"))
    assert by_name["learner"].command == (*cli, "learner", "--preset", str(config / "learner.yaml"))
    assert by_name["prompts"].command == (
        *cli,
        "prompts",
        "--preset",
        str(config / "prompts.yaml"),
        "--watch",
    )
    assert by_name["worker-1"].command == (
        *cli,
        "rollout",
        "--preset",
        str(config / "worker-1.yaml"),
        "--worker-id",
        "worker-1",
    )
    # redis-server under its keeper (redis_keeper.py), which stops it after the run's other services.
    assert by_name["redis"].command[1:3] == ("-m", "sparkrl.redis_keeper")
    assert by_name["redis"].command[-1] == str(config / "redis.conf")
    assert Path(by_name["redis"].command[3]).name == "redis-server"
    assert f"port {plan.settings.bus.url.rsplit(':', 1)[1].split('/')[0]}\n" in by_name["redis"].config
    assert {s.log_path for s in plan.services} == {tmp_path / "logs" / f"{n}.log" for n in by_name}


# ── progress and summary ──────────────────────────────────────────────────────────────────────────────


def _record(step: int, reward: float, **extra: object) -> dict[str, object]:
    metrics = {"rollout/reward_mean": reward, "loss/entropy": 2.0 - step / 10, "loss/value": -0.004}
    metrics |= {"loss/reg_tokens": 3.0, "rollout/staleness_mean": 0.5, "sync/seconds": 0.21}
    return {
        "step": step,
        "policy_version": step,
        "time": 1.7e9 + step,
        "metrics": metrics,
        "worker_versions": {"worker-0": step - 1, "worker-1": step},
        **extra,
    }


def _write_metrics(run_dir: Path, records: list[dict[str, object]], tail: str = "") -> None:
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (run_dir / "metrics.jsonl").write_text(lines + tail)


def test_progress_line_formats_a_step_row() -> None:
    assert progress_line(None) is None  # before the learner's first step
    expected = "step 12/40 | reward 0.31 | entropy 0.80 | loss -0.004 | versions w0:11 w1:12 | sync 0.21s"
    assert progress_line(StepMetrics.model_validate(_record(12, 0.314)), max_steps=40) == expected
    assert progress_line(StepMetrics.model_validate(_record(12, 0.314))).startswith("step 12 | reward")
    # Workers sort by number (w2 before w10); metrics the learner did not write are left out.
    row = {"step": 3, "policy_version": 3, "time": 1.0, "metrics": {}}
    row["worker_versions"] = {"worker-10": 3, "worker-2": 2, "edge": 1}
    assert progress_line(StepMetrics.model_validate(row), 5) == "step 3/5 | versions edge:1 w2:2 w10:3"


def test_the_progress_line_reads_the_telemetry_channel(redis_url: str, tmp_path: Path) -> None:
    cfg = SparkSettings(run_dir=str(tmp_path), bus={"url": redis_url}, learner={"max_steps": 9})
    stack = Stack(plan_stack(cfg, workers=1), services=["learner"])
    assert stack.progress() is None
    telemetry = Telemetry(RedisBus(cfg.bus))
    for step in (1, 2):
        telemetry.append(StepMetrics.model_validate(_record(step, 0.5)))
    assert stack.progress() == progress_line(StepMetrics.model_validate(_record(2, 0.5)), 9)
    assert stack.progress().startswith("step 2/9 | reward 0.50")
    # Where the learner says the run ends (its data runs out at step 4) is the total from then on.
    status = LearnerStatus(step=2, policy_version=2, state="training", groups_trained=8, group_epoch=1,
                           max_steps=4, heartbeat_at=time.time())  # fmt: skip
    telemetry.put_learner(status)
    assert stack.progress().startswith("step 2/4 | reward 0.50")
    telemetry.bus.close()
    stack.shutdown()


def test_before_the_first_step_the_line_says_what_is_starting(redis_url: str, tmp_path: Path) -> None:
    # (issue 12, item 2) a first run is not silence while DeepSpeed compiles its op.
    assert startup_line(12.4, None, "missing", {}, 900) == (
        "starting 12s (gives up at 900s) | learner: compiling DeepSpeed's op (first run, ~30-60 s) "
        "| workers: loading the model"
    )
    # (issue 36, item 7) a rebuild is told by torch's build lock, not by the library's absence; a built op
    # is not "building DeepSpeed's engine": the model loads.
    assert "learner: compiling DeepSpeed's op (~30-60 s, once)" in startup_line(4, None, "building", {})
    assert "learner: loading the model and DeepSpeed's engine" in startup_line(4, None, "built", {})
    line = startup_line(3, "training", "built", {"worker-10": "generating", "worker-2": "starting"})
    assert line == (
        "starting 3s | learner: training, waiting for the first groups | worker-2: starting | "
        "worker-10: generating"
    )
    cfg = SparkSettings(run_dir=str(tmp_path), bus={"url": redis_url}, learner={"max_steps": 9})
    stack = Stack(plan_stack(cfg, workers=1), services=["learner"])
    assert stack.progress() is None  # not started: no line
    stack.started_at = launcher.time.monotonic() - 5
    assert stack.progress().startswith("starting 5s (gives up at") and "learner: " in stack.progress()
    stack.shutdown()


def test_summarize_reports_and_writes_summary_json(tmp_path: Path) -> None:
    # Ten steps, reward 0.0 … 0.9: the first 20% are steps 1-2 (mean 0.05), the last 20% steps 9-10 (0.85).
    _write_metrics(tmp_path, [_record(step, (step - 1) / 10) for step in range(1, 11)])
    (tmp_path / "checkpoints" / "step-10").mkdir(parents=True)
    text = summarize(tmp_path)

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 10
    assert summary["reward_mean_first_20pct"] == pytest.approx(0.05)
    assert summary["reward_mean_last_20pct"] == pytest.approx(0.85)
    assert summary["final_entropy"] == pytest.approx(1.0)
    assert summary["policy_version"] == 10
    assert summary["worker_versions"] == {"worker-0": 9, "worker-1": 10}
    assert summary["checkpoints"] == ["step-10"]
    assert "10 steps" in text and "0.050" in text and "0.850" in text
    assert "learner 10 | workers w0:9 w1:10" in text and str(tmp_path / "checkpoints") in text


def test_summarize_counts_the_dead_letters_the_run_left(tmp_path: Path) -> None:
    records = [
        DeadLetterRecord(record_id=f"{i}-0", stream=stream, item_id=item, reason="r", time_ms=i, deliveries=1)
        for i, (stream, item) in enumerate(
            [("prompts", "p1"), ("prompts", "p2"), ("prompts", "p1"), ("trajectories", "g-1")]
        )
    ]
    (tmp_path / "dead_letters.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in records))
    text = summarize(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["dead_lettered"] == {"prompts": 2, "groups": 1}
    assert (
        "dead-lettered: 2 prompts (by the workers), 1 groups (by the learner): "
        f"`sparkrl dead --run-dir {tmp_path}` lists them"
    ) in text


def test_summarize_without_metrics(tmp_path: Path) -> None:
    assert "0 steps" in summarize(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["reward_mean_last_20pct"] is None


# ── real processes ────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_stack_starts_redis_and_reward_then_stops_them_cleanly(tmp_path: Path) -> None:
    cfg = SparkSettings(run_dir=str(tmp_path / "run"))
    plan = plan_stack(cfg, workers=1)
    write_configs(plan)
    stack = Stack(plan, services=["redis", "reward"], ready_timeout_s=30, grace_s=10)
    try:
        stack.start()
        assert httpx.get(f"{plan.settings.reward.url}/healthz", timeout=5).json()["status"] == "ok"
        assert redis.Redis.from_url(plan.settings.bus.url).ping()
        assert stack.poll() is None
        pids = [proc.pid for proc in stack.procs.values()]
        assert len(_group_members(stack.procs["reward"].pid)) > 1  # the verifier pool lives in its group
    finally:
        stack.shutdown()
    _assert_gone(pids)
    # SIGTERM was enough (uvicorn re-raises it after its graceful shutdown): no SIGKILL was needed.
    assert stack.procs["redis"].returncode == 0
    assert stack.procs["reward"].returncode in (0, -signal.SIGTERM)
    assert "verifier pool closed" in (tmp_path / "run" / "logs" / "reward.log").read_text()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_the_stack_keeps_the_dead_letters_before_its_redis_stops(tmp_path: Path) -> None:
    plan = plan_stack(SparkSettings(run_dir=str(tmp_path)), workers=1, private_redis=True)
    write_configs(plan)
    stack = Stack(plan, services=["redis"], ready_timeout_s=30)
    try:
        stack.start()
        with RedisBus(plan.settings.bus) as bus:
            assert bus.publish_prompt("too-long", b"x")
            (entry,) = bus.read("prompts", "worker", 1)
            assert bus.dead_letter("prompts", entry, "prompt has 900 tokens, over rollout.max_prompt_tokens")
    finally:
        stack.shutdown()
    (record,) = load_dead_letters(tmp_path)  # type: ignore[misc]
    assert (record.stream, record.item_id) == ("prompts", "too-long") and "900 tokens" in record.reason


def _fake_plan(run_dir: Path, services: dict[str, tuple[Role, str]]) -> StackPlan:
    """A plan whose services are small Python programs, to drive the supervisor through its cases."""
    specs = []
    for name, (role, code) in services.items():
        config = run_dir / "config" / f"{name}.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text("{}\n")
        command = (sys.executable, "-c", code)
        specs.append(
            ServiceSpec(name, role, command, config, SparkSettings(), run_dir / "logs" / f"{name}.log")
        )
    # Nothing listens on port 1: the progress line finds no Redis (and never touches the system's on 6379).
    # One restart each: a service that dies for good is given up quickly (test_supervision.py has more).
    settings = SparkSettings(
        run_dir=str(run_dir),
        learner={"max_steps": 3},
        bus={"url": "redis://127.0.0.1:1/0"},
        supervision={"max_restarts": 1},
    )
    return StackPlan(run_dir, settings, tuple(specs), False)


_SLEEP = "import time; time.sleep(60)"


def test_learner_exit_ends_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_metrics(tmp_path, [_record(3, 0.5)])
    plan = _fake_plan(
        tmp_path, {"learner": ("learner", "import time; time.sleep(0.5)"), "w": ("rollout", _SLEEP)}
    )
    stack = Stack(plan, grace_s=5)
    try:
        stack.start()
        assert stack.wait(poll_s=0.05) == 0
    finally:
        stack.shutdown()
    _assert_gone([proc.pid for proc in stack.procs.values()])
    assert stack.procs["w"].returncode == -signal.SIGTERM
    assert "learner finished" in capsys.readouterr().err


def test_dead_worker_is_tolerated_and_a_dead_service_stops_the_stack(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    boom = "import sys; print('boom: out of memory'); sys.exit(3)"
    # worker-1 ignores SIGTERM and has a child of its own: both must still go (SIGKILL after the grace).
    stubborn = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        f"subprocess.Popen([sys.executable, '-c', {_SLEEP!r}]); time.sleep(60)"
    )
    services: dict[str, tuple[Role, str]] = {
        "learner": ("learner", _SLEEP),
        "worker-0": ("rollout", boom),
        "worker-1": ("rollout", stubborn),
        "prompts": ("prompts", "import sys, time; time.sleep(0.8); print('feeder dies'); sys.exit(2)"),
    }
    stack = Stack(_fake_plan(tmp_path, services), grace_s=0.5)
    try:
        stack.start()
        assert stack.wait(poll_s=0.05) == 1
    finally:
        stack.shutdown()
    err = capsys.readouterr().err
    assert "warning: worker-0 exited with code 3; restarting it (1 of at most 1" in err
    assert (
        "warning: worker-0 exited with code 3, after 1 restart within" in err and "boom: out of memory" in err
    )
    assert "warning: prompts exited with code 2; restarting it" in err
    assert "error: prompts exited with code 2, after 1 restart within" in err and "feeder dies" in err
    assert "worker-1 did not stop within 0.5s: killing it" in err
    _assert_gone([proc.pid for proc in stack.procs.values()])
    assert stack.procs["worker-1"].returncode == -signal.SIGKILL
    assert stack.procs["learner"].returncode == -signal.SIGTERM


def test_run_stack_end_to_end_with_a_fake_learner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    learner = (
        "import json, time\n"
        "for step in (1, 2, 3):\n"
        f"    with open({str(metrics)!r}, 'a') as out:\n"
        "        row = {'step': step, 'policy_version': step, 'time': 1.0 + step}\n"
        "        out.write(json.dumps(row | {'metrics': {'rollout/reward_mean': step / 10}}) + '\\n')\n"
        "    time.sleep(0.1)\n"
    )
    plan = _fake_plan(tmp_path, {"learner": ("learner", learner), "worker-0": ("rollout", _SLEEP)})
    monkeypatch.setattr(launcher, "plan_stack", lambda cfg, workers, private_redis, resume: plan)

    assert run_stack(plan.settings, 1, None, "demo") == 0
    out = capsys.readouterr().out
    assert "sparkrl up: preset demo" in out and "3 steps" in out
    assert f"report: {tmp_path / 'report' / 'report.md'}" in out
    assert json.loads((tmp_path / "summary.json").read_text())["reward_mean_last_20pct"] == pytest.approx(0.3)
    assert load_settings(str(tmp_path / "config" / "learner.yaml")) == plan.services[0].config


def test_the_control_token_lives_in_a_0600_file_never_in_a_config(tmp_path: Path) -> None:
    plan = plan_stack(load_settings(None, [f"run_dir={tmp_path}"]), workers=1)
    write_configs(plan)
    token_file = tmp_path / "control-token"
    token = token_file.read_text().strip()
    assert len(token) >= 24 and token_file.stat().st_mode & 0o777 == 0o600
    assert all(token not in config.read_text() for config in (tmp_path / "config").iterdir())
    control = load_settings(str(tmp_path / "config" / "control.yaml")).control
    assert control.token is None and control.token_file == str(token_file)
    assert plan.page_url == f"{control.url}/"
    # The same run directory keeps its token, so scripts and open pages go on working after a restart.
    assert plan_stack(load_settings(None, [f"run_dir={tmp_path}"]), workers=1).control_token == token
    given = plan_stack(
        load_settings(None, [f"run_dir={tmp_path / 'b'}", "control.token=my-token"]), workers=1
    )
    write_configs(given)
    assert (tmp_path / "b" / "control-token").read_text() == "my-token\n"
    with pytest.raises(ValueError, match=r"refusing to write control\.token"):
        write_resolved(load_settings(None, ["control.token=abc"]), tmp_path / "x.yaml")


def test_services_get_neither_sparkrl_nor_torch_distributed_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MASTER_PORT", "29500")  # what an in-process DeepSpeed init leaves behind
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("SPARKRL_BUS__URL", "redis://elsewhere:6379/0")
    monkeypatch.setenv("SPARKRL_LOG_LEVEL", "DEBUG")
    env = processes.child_env()
    assert "MASTER_PORT" not in env and "RANK" not in env and "SPARKRL_BUS__URL" not in env
    assert env["SPARKRL_LOG_LEVEL"] == "DEBUG" and env["PYTHONUNBUFFERED"] == "1"
