"""A genuine, signed weight announcement written back later (a replay) is never followed: each carries the
learner's incarnation and a sequence number inside what is signed, and a worker follows only what is at
least as fresh as the newest it has seen. On a private redis-server, then on the real stack."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from _faults import assert_exactly_once, settings, steps_done, wait
from _live import Live
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import start_stack

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.proto import WeightAnnouncement, sign_announcement
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import BusSettings
from sparkrl.services.common.weight_sync import WeightSender
from sparkrl.services.rollout.announcements import ANNOUNCEMENT_KEY, AnnouncementGate

SECRET = "replay-test-secret-0123456789abcdef"


def _announce(sender: WeightSender, version: int, epoch: int = 1) -> WeightAnnouncement:
    tensors = {"w": torch.full((4,), float(version))}
    announcement = sender.announce(tensors, version=version, epoch=epoch, members=[])
    return sign_announcement(announcement, SECRET)


def test_the_gate_refuses_a_replay_and_follows_a_restarted_learner(
    bus_settings: BusSettings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, restarted = WeightSender(), None
    with RedisBus(bus_settings) as bus:
        gate = AnnouncementGate(bus, SECRET, tmp_path)

        def write(announcement: WeightAnnouncement) -> WeightAnnouncement | None:
            bus.set_value(ANNOUNCEMENT_KEY, announcement.model_dump_json())
            return gate.latest()

        try:
            v1, v2 = _announce(first, 1), _announce(first, 2)
            assert write(v1) == v1 and write(v2) == v2
            assert gate.latest() == v2  # the same announcement read again is still the current one
            with caplog.at_level(logging.ERROR, logger="sparkrl.rollout"):
                assert write(v1) is None  # genuine, signed, and older: a replay
            assert "version 1 (announcement 0) is older than version 2 (announcement 1)" in caplog.text
            assert "replayed" in caplog.text
            again = _announce(first, 2, epoch=2)  # version 2 again, for a new group epoch: fresh
            assert write(again) == again

            restarted = WeightSender()  # a learner restarted (resumed to an older version): followed back
            back = _announce(restarted, 1)
            assert back.incarnation > v2.incarnation and write(back) == back
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="sparkrl.rollout"):
                assert write(_announce(first, 3)) is None  # the old incarnation, even with a newer version
            assert "earlier learner incarnation" in caplog.text
            # The freshness is part of what is signed: it cannot be edited past the check.
            forged = back.model_copy(update={"sequence": back.sequence + 10})
            assert write(forged) is None
        finally:
            first.close()
            if restarted is not None:
                restarted.close()


@pytest.mark.slow
def test_a_replayed_announcement_on_the_live_stack_is_refused_and_the_fleet_stays_in_the_broadcast(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """Pause the run at a step boundary (no announcement is written meanwhile), write back the signed
    announcement of an older version, let every worker see it, resume: each worker refuses it with the
    reason, every later broadcast reaches both workers, and every group is trained exactly once."""
    steps, per_step = 10, 4
    cfg = settings(
        tiny_model_dir,
        tmp_path / "run",
        f"learner.max_steps={steps}",
        f"learner.prompts_per_step={per_step}",
        f"prompts.count={steps * per_step}",
        f"sync.secret={SECRET}",
        "control.command_timeout_s=60",
    )
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    live = Live(plan, stack, plan.settings.control.url, plan.token_path.read_text().strip())
    with RedisBus(plan.settings.bus) as bus:
        wait("step 2", lambda: steps_done(plan.run_dir) >= 2, plan.run_dir)
        old = bus.get_value(ANNOUNCEMENT_KEY)
        assert old is not None
        wait("step 4", lambda: steps_done(plan.run_dir) >= 4, plan.run_dir)
        assert live.send("POST", "/api/v1/pause").status_code == 200
        # The learner's last version before the pause goes out on the publisher's thread: once its
        # broadcast is done, no genuine announcement is written until the resume.
        version = int(live.get("/api/v1/status")["policy_version"])

        def broadcast_done() -> bool:
            syncs = (plan.run_dir / "weights.jsonl").read_text().splitlines()
            return bool(syncs) and json.loads(syncs[-1])["version"] == version

        wait(f"version {version}'s broadcast", broadcast_done, plan.run_dir)
        replayed = WeightAnnouncement.model_validate_json(old)
        paused_at = WeightAnnouncement.model_validate_json(bus.get_value(ANNOUNCEMENT_KEY) or b"")
        assert replayed.version < paused_at.version == version
        bus.set_value(ANNOUNCEMENT_KEY, old)
        refusal = f"refusing a weight announcement: version {replayed.version} (announcement"
        logs = [plan.run_dir / "logs" / f"worker-{i}.log" for i in range(2)]
        wait(
            "both workers to refuse the replay",
            lambda: all(refusal in log.read_text(errors="replace") for log in logs),
            plan.run_dir,
        )
        assert live.send("POST", "/api/v1/resume").status_code == 200
        learner = stack.procs["learner"]
        wait("the learner to finish", lambda: learner.poll() is not None, plan.run_dir)
        assert learner.returncode == 0
    syncs = [json.loads(line) for line in (plan.run_dir / "weights.jsonl").read_text().splitlines()]
    after = [e for e in syncs if e["version"] > paused_at.version]
    assert after and all(e["outcome"] == "ok" and not e["dropped"] for e in after), after
    assert all(sorted(e["acknowledged"]) == ["worker-0", "worker-1"] for e in after), after
    for log in logs:  # after refusing the replay, no worker follows it (whatever it followed before)
        after_refusal = log.read_text().split(refusal, 1)[1]
        assert f"now on policy version {replayed.version} " not in after_refusal
    assert_exactly_once(plan, steps)
