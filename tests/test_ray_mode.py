"""`sparkrl up --ray` on a local Ray (2 CPUs): the learner and the workers are Ray actors, the reward
service a Ray Serve deployment. The actors' default requests (1 CPU each) are fitted to the 2 CPUs; a run
finishes its steps. One worker actor's process is killed mid-run: Ray restarts it and it joins the
broadcast group again while training goes on; then SIGTERM to the driver ends the run cleanly, with its
summary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env

ray = pytest.importorskip("ray", reason="Ray mode needs the `ray` extra (pip install 'sparkrl[ray]')")

pytestmark = pytest.mark.slow

MAX_STEPS = 100_000  # the run ends by `sparkrl stop` once the restarted worker is back, whatever the pace


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _logs(run_dir: Path) -> str:
    return "\n".join(
        f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        for log in sorted((run_dir / "logs").glob("*.log"))
    )


def test_worker_actors_are_restarted_and_rejoin(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    run_dir = tmp_path / "run"
    overrides = [
        f"model={tiny_model_dir}",
        f"learner.max_steps={MAX_STEPS}",
        "learner.max_staleness=1000",
        "prompts.count=20000",
        "sync.timeout_s=10",
        "bus.claim_idle_ms=2000",
        "ray.num_cpus=2",  # the actors' requests are left at their defaults: fitted to these 2 CPUs
    ]
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--ray", "--preset", "smoke", "--workers", "2"]
    command += ["--run-dir", str(run_dir)] + [a for o in overrides for a in ("--set", o)]
    env = clean_env()
    env["RAY_AUTH_MODE"] = "disabled"
    out = (tmp_path / "up.log").open("wb")
    driver = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        # Wait for a few steps, then SIGKILL worker-0's actor process (its id carries the pid).
        deadline = time.monotonic() + 400
        victim: int | None = None
        while victim is None:
            assert driver.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            rows = _read_jsonl(run_dir / "metrics.jsonl")
            syncs = _read_jsonl(run_dir / "weights.jsonl")
            members = {m for e in syncs if e["outcome"] == "ok" for m in e["acknowledged"]}
            first = [m for m in members if m.startswith("worker-0.")]
            if rows and rows[-1]["step"] >= 3 and first:
                victim = int(first[0].rsplit(".", 1)[1])
            elif time.monotonic() > deadline:
                pytest.fail(f"no step 3 with worker-0 in the group\n{_logs(run_dir)}")
            else:
                time.sleep(0.5)
        step_at_kill = _read_jsonl(run_dir / "metrics.jsonl")[-1]["step"]
        os.kill(victim, signal.SIGKILL)
        reborn: set[str] = set()
        deadline = time.monotonic() + 300
        while not reborn:
            assert driver.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            if time.monotonic() > deadline:
                pytest.fail(f"no restarted worker-0 joined the broadcast group\n{_logs(run_dir)}")
            syncs = _read_jsonl(run_dir / "weights.jsonl")
            reborn = {
                m
                for e in syncs
                if e["outcome"] == "ok"
                for m in e["acknowledged"]
                if m.startswith("worker-0.") and m != f"worker-0.{victim}"
            }
            time.sleep(0.5)
        driver.send_signal(signal.SIGTERM)  # the driver alone, as a supervisor would
        code = driver.wait(timeout=300)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGINT)
            driver.wait(60)
    text = (tmp_path / "up.log").read_text()
    assert code == 130, f"{text[-3000:]}\n{_logs(run_dir)}"  # interrupted, and stopped in order
    assert "requests fitted" in text and "ray.rollout.num_cpus 1 → 0.5" in text
    assert f"run {run_dir}:" in text and "ended: stopped" in text, text[-2000:]  # the summary
    assert "SIGTERM received" not in text  # no stack dumps from Ray's own processes
    rows = _read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # training never stopped
    assert rows[-1]["step"] > step_at_kill  # and went on after the kill
    syncs = _read_jsonl(run_dir / "weights.jsonl")
    joined = [e["version"] for e in syncs if e["outcome"] == "ok" and reborn & set(e["acknowledged"])]
    assert joined and min(joined) > step_at_kill  # the restarted worker followed the live learner
    log = (run_dir / "logs" / "worker-0.log").read_text()
    assert "restarted by Ray" in log
    assert "Ray Serve" in text  # the reward service ran as a Serve deployment


def test_a_run_with_default_requests_finishes_on_two_cpus(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """The learner, the worker and the reward replica each ask Ray for 1 CPU by default: on 2 CPUs they
    used to wait forever; fitted, the run reaches its last step."""
    run_dir = tmp_path / "run"
    overrides = [f"model={tiny_model_dir}", "learner.max_steps=4", "prompts.count=400", "ray.num_cpus=2"]
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--ray", "--preset", "smoke", "--workers", "1"]
    command += ["--run-dir", str(run_dir)] + [a for o in overrides for a in ("--set", o)]
    env = clean_env() | {"RAY_AUTH_MODE": "disabled"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    text = done.stdout + done.stderr
    assert done.returncode == 0, f"{text[-3000:]}\n{_logs(run_dir)}"
    assert "Ray cluster of 2 CPUs: requests fitted" in text
    # (issue 36, item 7) Ray said in one line of the run's, not its own alarming start and end lines.
    assert "Ray: a local cluster for this run, token authentication off (RAY_AUTH_MODE)" in text
    assert "Started a local Ray instance" not in text and "(raylet)" not in text, text[-3000:]
    assert [r["step"] for r in _read_jsonl(run_dir / "metrics.jsonl")][-1] == 4


def test_requests_that_cannot_fit_are_refused_with_the_numbers() -> None:
    from sparkrl.ray_mode import fit_to_cluster
    from sparkrl.services.common.settings import load_settings

    defaults = load_settings("smoke")
    fitted, refused = fit_to_cluster(defaults, workers=2, cpus=2)
    assert not refused and defaults.ray.learner.num_cpus == defaults.ray.rollout.num_cpus == 0.5
    assert fitted == [
        "ray.learner.num_cpus 1 → 0.5",
        "ray.rollout.num_cpus 1 → 0.5",
        "ray.reward.num_cpus 1 → 0.5",
    ]
    explicit = load_settings("smoke", ["ray.learner.num_cpus=2", "ray.rollout.num_cpus=1"])
    fitted, refused = fit_to_cluster(explicit, workers=2, cpus=2)
    assert explicit.ray.learner.num_cpus == 2 and explicit.ray.rollout.num_cpus == 1  # what you set is kept
    assert refused and "ask for 4.5 CPUs (learner 1 × 2, rollout 2 × 1, reward 1 × 0.5)" in refused[0]
    assert "the Ray cluster has 2" in refused[0] and "ray.rollout.num_cpus" in refused[0]
