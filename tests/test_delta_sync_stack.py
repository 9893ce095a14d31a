"""`sync.delta` in a real run (issue 50 item 4): the smoke stack (private redis-server, two workers, the
DeepSpeed learner) announces versions as deltas once every member holds the last one, the workers apply
them and hold exactly the learner's version (their checksum is the announced one), and every group is
trained once. The learner here is float32, where nearly every element moves each step: the delta carries
most tensors whole (docs/benchmarks.md); what is tested is the path."""

from __future__ import annotations

from pathlib import Path

import pytest
from _faults import assert_exactly_once, settings, steps_done, wait
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import start_stack

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.common.weight_sync import ANNOUNCEMENT_KEY

pytestmark = pytest.mark.slow

STEPS = 5


def test_a_run_with_delta_sync_keeps_every_worker_on_the_learners_version(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    run_dir = tmp_path / "run"
    cfg = settings(tiny_model_dir, run_dir, "sync.delta=true", f"learner.max_steps={STEPS}")
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    start_stack(stacks, Stack(plan, ready_timeout_s=180))
    seen: list[WeightAnnouncement] = []
    with RedisBus(plan.settings.bus) as bus:

        def delta_held() -> bool:
            raw = bus.get_value(ANNOUNCEMENT_KEY)
            if raw is None:
                return False
            announcement = WeightAnnouncement.model_validate_json(raw)
            if not seen or seen[-1].version != announcement.version:
                seen.append(announcement)
            held = {s.weights_checksum for s in Telemetry(bus).workers().values()}
            return announcement.delta_base is not None and held == {announcement.checksum}

        wait("a delta version every worker holds", delta_held, run_dir, timeout_s=300)
    wait("the run's end", lambda: (run_dir / "ended.json").is_file(), run_dir)
    assert_exactly_once(plan, STEPS, queued_ok=True)
    assert steps_done(run_dir) == STEPS
