"""Lockstep generation: the counting rule alone, then the on-policy preset for real (private Redis, reward
service, two workers, the DeepSpeed learner): every step trains exactly one step's groups, all sampled
with the weights the learner held, none dropped."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from _tiny import tiny_model_dir  # noqa: F401  (fixture)

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.services.common.settings import load_settings
from sparkrl.services.rollout.lockstep import Lockstep


def test_a_worker_holds_after_its_share_until_a_new_version_or_the_wait_runs_out() -> None:
    assert not Lockstep(None, wait_s=1.0).holds(3)  # asynchronous: never waits
    lockstep = Lockstep(8, wait_s=0.2)
    assert not lockstep.holds(1)
    lockstep.record(1, 4)
    assert not lockstep.holds(1)  # half the share
    lockstep.record(1, 4)
    assert lockstep.holds(1)  # the share is out: wait for version 2
    assert not lockstep.holds(2)  # new weights, new share
    lockstep.record(1, 8)  # groups made with the old version, published late, count for it only
    assert not lockstep.holds(2)
    lockstep.record(2, 8)
    assert lockstep.holds(2)
    time.sleep(0.25)
    assert not lockstep.holds(2)  # no new version in time: make more rather than wait forever
    assert lockstep.made == 0


@pytest.mark.slow
def test_the_on_policy_preset_trains_each_step_on_its_own_version_only(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    steps, workers = 6, 2
    overrides = [f"model={tiny_model_dir}", f"run_dir={tmp_path / 'run'}", f"learner.max_steps={steps}"]
    overrides += [f"workers={workers}", "rollout.lockstep_groups=8", "learner.checkpoint_every=1000"]
    plan = plan_stack(load_settings("onpolicy", overrides), workers=workers, private_redis=True)
    write_configs(plan)
    stack = Stack(plan)
    try:
        stack.start()
        learner = stack.procs["learner"]
        deadline = time.monotonic() + 240
        while learner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert learner.returncode == 0, (plan.run_dir / "logs" / "learner.log").read_text()[-3000:]
    finally:
        stack.shutdown()
    rows = [json.loads(line) for line in (plan.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert row["metrics"]["rollout/groups"] == 16  # one step's worth, no burst joined
        assert row["metrics"]["rollout/staleness_mean"] == 0  # sampled by the weights being trained
        assert row["metrics"]["rollout/dropped_stale"] == 0  # and nothing made only to be thrown away
    for log in (plan.run_dir / "logs").glob("worker-*.log"):
        assert "lockstep: no version" not in log.read_text()  # no wait ran out
