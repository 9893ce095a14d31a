"""Partial rollouts across turns on the real stack (issue 48, item 4): two torch-engine workers play
multi-turn episodes whose environments the environment service holds (`env.enabled`, the tests'
`SlowTalker`: a second a turn, four turns); worker-0 is stopped (SIGTERM) between turns, hands its
episodes over (saved, prompts released), and worker-1 plays the same episodes on — in the service, from
the turn they had reached — to their ends; every group is trained once, and every episode reached its end
(the environment's reward is 1 only then)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from _faults import assert_exactly_once, settings, wait
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import start_stack

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.services.common.bus import RedisBus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS, PER_STEP = 4, 2
HANDED = re.compile(
    r"handed (\d+) groups of episodes over \((\d+) episodes running; (\d+) prompts released\)"
)
PLAYED_ON = re.compile(r"playing on (\d+) episodes of (\S+) from worker-0")


def test_a_stopped_workers_episodes_are_played_on_by_another_and_trained_once(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent))  # the service loads _code_envs
    cfg = settings(
        tiny_model_dir,
        tmp_path / "run",
        "env.enabled=true",
        "rollout.agent.environment=_code_envs:SlowTalker",
        "rollout.agent.reward=environment",
        "rollout.agent.max_turns=8",
        "rollout.partial.enabled=true",
        "rollout.sampling.n=2",
        "rollout.sampling.max_new_tokens=6",
        f"prompts.count={PROMPTS}",
        f"learner.prompts_per_step={PER_STEP}",
        "learner.max_steps=100",  # the data ends the run
        "learner.checkpoint_every=100",
    )
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    with RedisBus(plan.settings.bus) as bus:
        wait(
            "worker-0 generating",
            lambda: '"generating"' in (bus.status("worker", "worker-0") or ""),
            plan.run_dir,
        )
    time.sleep(1.5)  # into its episodes' second turn: the service holds them mid-way
    os.killpg(stack.procs["worker-0"].pid, signal.SIGTERM)  # as `sparkrl up` or a scale-down stops one
    assert stack.procs["worker-0"].wait(60) == 0
    learner = stack.procs["learner"]
    wait("the data to run out", lambda: learner.poll() is not None, plan.run_dir, timeout_s=400)
    assert learner.returncode == 0, (plan.run_dir / "logs" / "learner.log").read_text()[-3000:]
    assert_exactly_once(plan, PROMPTS // PER_STEP)  # every group trained once: none lost, none twice

    logs = plan.run_dir / "logs"
    handed = HANDED.search((logs / "worker-0.log").read_text())
    assert handed, (logs / "worker-0.log").read_text()[-2000:]
    groups, running, released = (int(x) for x in handed.groups())
    assert groups == released > 0 and running > 0
    played_on = PLAYED_ON.findall((logs / "worker-1.log").read_text())
    assert len(played_on) == groups and all(int(count) == 2 for count, _ in played_on)
    rows = [json.loads(line)["metrics"] for line in (plan.run_dir / "metrics.jsonl").read_text().splitlines()]
    # Every episode reached its end (4 model turns), those handed over too: reward 1, always.
    assert all(r["rollout/reward_mean"] == 1.0 and r["rollout/model_turns_mean"] == 4.0 for r in rows), rows
