"""A 2 MB prompt fed into a live run (issue 45, item 4) on the real stack (private redis-server, a worker,
the DeepSpeed learner): through `sparkrl prompts` it is refused by the feeder with its reason, and the same
prompt published by a producer that skips the feeder is dead-lettered by the worker with its reason,
untokenized — the worker's memory stays flat (it prefilled 2,000,000 tokens before: RSS 0.6 → 10.9 GB).
The one-off feed keeps the run's feed-done mark and adds its own."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _faults import settings, steps_done, wait
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env, start_stack

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.proto import Prompt, encode_message
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.feeder import FEED_KIND

pytestmark = pytest.mark.slow

TWO_MB = 2_000_000
FLAT_MB = 300  # the worker's RSS may grow this much at most while it meets the huge prompt
# The smoke preset on the tiny model: 256 positions less 16 new tokens, 32 characters a token.
REASON = (
    f"prompt has {TWO_MB} characters, over rollout.max_prompt_tokens (240, the model's context 256 − "
    "rollout.sampling.max_new_tokens 16) × rollout.max_prompt_chars_per_token (32) = 7680: not tokenized"
)


def rss_mb(pid: int) -> float:
    """The process's resident set, MB (/proc/PID/status VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_2mb_prompt_fed_into_a_live_run_is_refused_or_dead_lettered_and_memory_stays_flat(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    # A short prompt stream (the feeder keeps it full): what is fed later is taken within seconds.
    overrides = ("learner.max_steps=400", "prompts.count=1600", "bus.prompt_maxlen=16")
    cfg = settings(tiny_model_dir, tmp_path / "run", *overrides)
    plan = plan_stack(cfg, workers=1, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    wait("step 2", lambda: steps_done(plan.run_dir) >= 2, plan.run_dir)  # the worker has generated
    worker = stack.procs["worker-0"].pid
    baseline = rss_mb(worker)
    with RedisBus(plan.settings.bus) as bus:
        wait("the run's feed", lambda: bool(bus.statuses(FEED_KIND)), plan.run_dir)
        run_marks = bus.statuses(FEED_KIND)

        # Through `sparkrl prompts` into the live run: refused, with its reason; the small one fed.
        data = tmp_path / "huge.jsonl"
        rows = [{"prompt": "x" * TWO_MB, "answer": "1"}, {"prompt": "What is 1 + 1?", "answer": "2"}]
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        given = [f"prompts.path={data}", "prompts.task=math", "prompts.epochs=1"]
        one_off = subprocess.run(
            [sys.executable, "-m", "sparkrl.cli", "prompts", "--run-dir", str(plan.run_dir),
             *(arg for setting in given for arg in ("--set", setting))],
            capture_output=True, text=True, timeout=180, env=clean_env(),
        )  # fmt: skip
        said = one_off.stdout + one_off.stderr
        assert one_off.returncode == 0, said
        assert f"not feeding prompt huge-000000: {REASON}" in said
        assert "epoch 0: 1 prompts fed, 0 already there, 1 refused (over the prompt limit)" in said
        (refused,) = [
            d for d in bus.dead_letters(50) if d.item_id == "huge-000000"
        ]  # `sparkrl dead` shows it
        assert refused.reason == f"refused by the feeder: {REASON}" and refused.stream.endswith(":prompts")
        marks = bus.statuses(FEED_KIND)
        assert len(marks) == len(run_marks) + 1  # its own mark beside the run's, which is as it was
        assert all(marks[name] == mark for name, mark in run_marks.items())
        (own,) = [json.loads(mark) for name, mark in marks.items() if name.startswith("huge.jsonl-")]
        assert (own["state"], own["prompts"]) == ("fed", 1)

        # A producer that skips the feeder: the worker dead-letters it before tokenizing.
        huge = Prompt(prompt_id="huge-direct", task="math", text="x" * TWO_MB, answer="1")
        assert bus.publish_prompt(huge.prompt_id, encode_message(huge))
        peak, deadline = baseline, time.monotonic() + 120
        while not [d for d in bus.dead_letters(50) if d.item_id == "huge-direct"]:
            assert time.monotonic() < deadline, "the worker never dead-lettered the huge prompt"
            peak = max(peak, rss_mb(worker))
            time.sleep(0.05)
        (dead,) = [d for d in bus.dead_letters(50) if d.item_id == "huge-direct"]
        assert dead.reason == REASON
        for _ in range(20):  # and after: nothing of it left growing
            peak = max(peak, rss_mb(worker))
            time.sleep(0.1)
    assert stack.procs["worker-0"].poll() is None and stack.procs["learner"].poll() is None
    print(f"worker RSS {baseline:.0f} → {peak:.0f} MB (peak) meeting a {TWO_MB:,}-character prompt")
    assert peak - baseline < FLAT_MB, f"worker RSS {baseline:.0f} → {peak:.0f} MB"
    steps_then = steps_done(plan.run_dir)
    wait("the learner to go on", lambda: steps_done(plan.run_dir) > steps_then, plan.run_dir, timeout_s=60)
