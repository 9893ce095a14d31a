"""The sandbox under attack in a real run (issue 48): `sparkrl up` plays episodes of the tests' `Attacks`
environment (tests/_code_envs.py, loaded by its import path as a user's own environment is), whose every
turn runs hostile code in the shipped Python tool — an infinite loop, a 10 GB allocation, a fork bomb, a
connection to this machine's Redis, a write outside its folder, 100 MB of output. Each attack is an
observation the model sees in the next turn, within the sandbox's timeout; the worker is never restarted,
the run trains every step, and no process of a sandbox's own uids is left."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _code_envs import ATTACKS, LIMITS
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env

from sparkrl.services.common.sandbox import FIRST_UID, UID_SPAN

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
STATUSES = {  # what the sandbox makes of each attack (tests/test_sandbox.py holds each on its own)
    "loop": {"cpu_limit", "timeout"},
    "memory": {"tool_error"},
    "fork": {"tool_error", "timeout", "cpu_limit", "killed"},
    "socket": {"tool_error"},
    "write": {"tool_error"},
    "flood": {"tool_error"},
}
SAID = re.compile(r"\[(\w+): (\w+) ([\d.]+)s\]")  # _code_envs.said


def sandbox_processes() -> list[int]:
    """Processes running as a sandbox call's own uid (as root every call has one)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                uid = entry.stat().st_uid
            except FileNotFoundError:  # it ended while we looked
                continue
            if FIRST_UID <= uid < FIRST_UID + UID_SPAN:
                found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's own uids and namespaces need root (CI's)")
def test_a_run_whose_tool_is_attacked_every_turn_goes_on(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    run_dir = tmp_path / "run"
    overrides = [
        f"model={tiny_model_dir}",
        "rollout.agent.environment=_code_envs:Attacks",
        f"rollout.agent.max_turns={len(ATTACKS) + 1}",
        "rollout.agent.max_tokens=256",
        "rollout.sampling.n=2",
        "rollout.sampling.max_new_tokens=8",
        "learner.prompts_per_step=2",
        "learner.max_steps=1",
        "workers=1",
        "learner.skip_zero_advantage=false",  # every episode scores 0: measured all the same
    ]
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--preset", "smoke", "--run-dir", str(run_dir)]
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    env = clean_env() | {"PYTHONPATH": path}  # the environment loads by its import path, as a user's
    done = subprocess.run(
        [*command, *(a for o in overrides for a in ("--set", o))],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    # Token-exact through the stack: step 1 is on-policy, and the learner's log-probs of every model token,
    # teacher-forced over the episodes' streams (the tool's observations between the turns), are the
    # worker's; the observations are most of the stream, and none of it is trained.
    first = rows[0]["metrics"]
    assert abs(first["loss/ratio_mean"] - 1) < 1e-4 and abs(first["loss/ratio_kl"]) < 1e-6, first
    assert first["rollout/environment_token_share"] > 0.5 and first["rollout/model_turns_mean"] > 5
    worker_log = (run_dir / "logs" / "worker-0.log").read_text()
    assert "restarted" not in worker_log
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    seen = [
        (name, status, float(seconds))
        for sample in samples
        for name, status, seconds in SAID.findall(sample["completion"])
    ]
    assert {name for name, _, _ in seen} == set(ATTACKS), f"the attacks the model saw: {seen}"
    assert all(s["status"] != "error" for s in samples)  # scored by the verifier as any episode
    assert all(status in STATUSES[name] for name, status, _ in seen), seen
    # Within its timeout: the wall limit, and the kill of whatever was left (generous on a shared machine).
    assert max(seconds for _, _, seconds in seen) < LIMITS.wall_s + 5, seen
    assert not Path("/etc/sparkrl-was-here").exists()
    assert sandbox_processes() == [], "a sandbox's process outlived its call"
