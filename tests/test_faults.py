"""Faults injected into the real stack (private redis-server or an external one, two workers, the
DeepSpeed learner, loopback only): after each, every published group is trained exactly once."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from _faults import History, assert_exactly_once, kill9, published_group_ids, settings, steps_done, wait
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import start_stack

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.services.learner.ledger import Journal

pytestmark = pytest.mark.slow

STEPS, PER_STEP = 10, 4


def run_settings(model_dir: Path, run_dir: Path, *extra: str):
    return settings(
        model_dir,
        run_dir,
        f"learner.max_steps={STEPS}",
        f"learner.prompts_per_step={PER_STEP}",
        "learner.checkpoint_every=4",
        f"prompts.count={STEPS * PER_STEP}",
        *extra,
    )


def test_learner_killed_between_checkpoints_resumes_alone_and_replays(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """kill -9 the learner after step 5 (checkpoint at 4): the groups of step 5 were acknowledged and
    marked trained, so only the journal holds them; the resumed learner replays them."""
    cfg = run_settings(tiny_model_dir, tmp_path / "run")
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    wait("step 5", lambda: steps_done(plan.run_dir) >= 5, plan.run_dir)
    kill9(stack, "learner")
    killed_at = steps_done(plan.run_dir)
    assert 5 <= killed_at < 8 and (plan.run_dir / "journal").is_dir()
    assert Journal(plan.run_dir).steps(), "the steps since the checkpoint are journaled"

    # The same bus, ports and workers; only the learner comes back, with --resume.
    resumed_cfg = plan.settings.model_copy(deep=True)
    again = plan_stack(resumed_cfg, workers=2, private_redis=False, resume=True)
    learner = start_stack(stacks, Stack(again, services=["learner"], ready_timeout_s=180))
    wait("the resumed learner to finish", lambda: learner.procs["learner"].poll() is not None, plan.run_dir)
    assert learner.procs["learner"].returncode == 0
    history = assert_exactly_once(plan, STEPS)
    assert history.records > STEPS, "the rolled-back steps were redone, and the trail says so"
    assert "replaying step 5 from the journal" in (plan.run_dir / "logs" / "learner.log").read_text()
    # The final checkpoint (10) holds every step; the journal keeps those since the one before it (8), so
    # a resume can fall back to that one if the final one does not load.
    assert Journal(plan.run_dir).steps() == [9, 10]


def test_the_whole_stack_killed_then_sparkrl_up_resume(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """kill -9 the learner, stop everything, `up --resume`: the private Redis comes back from its
    append-only file in the run directory, so the feeder feeds nothing twice and nothing is retrained."""
    cfg = run_settings(tiny_model_dir, tmp_path / "run")
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    wait("step 5", lambda: steps_done(plan.run_dir) >= 5, plan.run_dir)
    kill9(stack, "learner")
    stack.shutdown()
    stacks.remove(stack)

    resumed = plan_stack(cfg, workers=2, private_redis=True, resume=True)
    write_configs(resumed)
    stack = start_stack(stacks, Stack(resumed, ready_timeout_s=180))
    learner = stack.procs["learner"]
    wait("the resumed run to finish", lambda: learner.poll() is not None, plan.run_dir)
    assert learner.returncode == 0
    assert_exactly_once(resumed, STEPS)
    feeder = (plan.run_dir / "logs" / "prompts.log").read_text()
    assert f"0 prompts fed, {STEPS * PER_STEP} already there" in feeder


def test_the_private_redis_killed_is_restarted_and_loses_nothing(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    cfg = run_settings(tiny_model_dir, tmp_path / "run")
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    wait("step 3", lambda: steps_done(plan.run_dir) >= 3, plan.run_dir)
    kill9(stack, "redis")
    # The launcher's supervision loop (what `sparkrl up` runs) notices and restarts it.
    wait("the learner to finish", lambda: stack.poll() is not None, plan.run_dir)
    assert stack.procs["learner"].returncode == 0
    assert len(stack.redis_restarts) == 1
    assert_exactly_once(plan, STEPS)


def test_an_external_redis_restarted_empty_is_rebuilt_and_refed(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
    spawn_redis,
) -> None:
    """An external Redis without persistence restarts empty: the learner rebuilds its trained marks from
    the audit trail, the feeder feeds again what was not trained, and the run completes exactly once."""
    server = spawn_redis()
    cfg = run_settings(tiny_model_dir, tmp_path / "run", f"bus.url={server.url}", "bus.reconnect_max_s=60")
    plan = plan_stack(cfg, workers=2, private_redis=False)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    wait("step 3", lambda: steps_done(plan.run_dir) >= 3, plan.run_dir)
    server.stop()
    server.start()
    learner = stack.procs["learner"]
    wait("the learner to finish", lambda: learner.poll() is not None, plan.run_dir, timeout_s=300)
    assert learner.returncode == 0
    from sparkrl.proto import group_id_for
    from sparkrl.services.common.tasks.datasets import iter_prompts

    every_prompt = {group_id_for(p.prompt_id) for p in iter_prompts(cfg.prompts)}
    assert_exactly_once(plan, STEPS, groups=every_prompt)
    log = (plan.run_dir / "logs" / "learner.log").read_text()
    assert "lost its data" in log and "rebuilt" in log
    assert "keeps nothing" in log or "persists nothing" in log  # said loudly at start
    # Stopped while Redis is down, a worker stops within the launcher's grace and says why, instead of
    # reconnecting for bus.reconnect_max_s (60 s) until it is killed (SIGKILL: returncode -9).
    server.stop()
    stack.shutdown()
    for name in ("worker-0", "worker-1"):
        assert stack.procs[name].returncode == 0, f"{name} ended {stack.procs[name].returncode}"
        assert "without Redis" in (plan.run_dir / "logs" / f"{name}.log").read_text()


def test_a_hung_worker_costs_time_not_data(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """SIGSTOP one worker mid-run (alive, sockets open, silent): the broadcast names and drops it within
    `sync.straggler_s`, the healthy worker keeps up with the versions that do go out, and the learner
    waits for it rather than throwing its groups away as stale."""
    steps = 16
    cfg = settings(
        tiny_model_dir,
        tmp_path / "run",
        f"learner.max_steps={steps}",
        f"learner.prompts_per_step={PER_STEP}",
        "learner.max_staleness=2",  # tight, as in the demo: a stalled broadcast used to drop nearly all
        "sync.timeout_s=60",
        "sync.straggler_s=2",
        f"prompts.count={steps * PER_STEP * 2}",
    )
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    wait("step 3", lambda: steps_done(plan.run_dir) >= 3, plan.run_dir)
    os.kill(stack.procs["worker-1"].pid, signal.SIGSTOP)
    try:
        learner = stack.procs["learner"]
        wait("the learner to finish", lambda: learner.poll() is not None, plan.run_dir, timeout_s=300)
        assert learner.returncode == 0
    finally:
        os.kill(stack.procs["worker-1"].pid, signal.SIGCONT)
    rows = [json.loads(line) for line in (plan.run_dir / "metrics.jsonl").read_text().splitlines()]
    dropped = sum(row["metrics"]["rollout/dropped_stale"] for row in rows)
    assert dropped < PER_STEP, f"a hung worker cost {dropped:.0f} groups of dropped data"
    syncs = [json.loads(line) for line in (plan.run_dir / "weights.jsonl").read_text().splitlines()]
    cut = next(i for i, e in enumerate(syncs) if "worker-1" in e["dropped"])
    after = next(e for e in syncs[cut + 1 :] if e["outcome"] == "ok")
    assert after["acknowledged"] == ["worker-0"], "the healthy worker got the next broadcast"
    final = rows[-1]
    assert final["worker_versions"]["worker-0"] == final["policy_version"]
    history = History.read(plan.run_dir)
    trained = sum(int(row["metrics"]["rollout/groups"]) for row in rows)  # a step may take more, not fewer
    assert len(history.group_ids) == len(set(history.group_ids)) == trained >= steps * PER_STEP


def test_poison_groups_on_the_live_stack_cost_only_themselves(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """Well-formed groups the learner's model cannot take (another vocabulary; ids past the embedding;
    a top-k of another width, which trains) published into a running stack: the learner goes on, each
    bad one is dead-lettered alone with its reason, every good group is trained exactly once."""
    import numpy as np

    from sparkrl.proto import encode_group
    from sparkrl.proto.testing import random_group
    from sparkrl.services.common.bus import RedisBus

    cfg = run_settings(tiny_model_dir, tmp_path / "run", f"learner.max_steps={STEPS + 1}")
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    wait("step 2", lambda: steps_done(plan.run_dir) >= 2, plan.run_dir)

    def group(seed: int, vocab: int, k: int):
        g = random_group(np.random.default_rng(seed), n=4, T=6, k=k, vocab_size=vocab, max_new_tokens=16)
        fresh = [
            c.model_copy(update={"policy_versions": np.zeros_like(c.policy_versions)}) for c in g.completions
        ]
        return g.model_copy(update={"prompt_token_ids": g.prompt_token_ids[:10], "completions": fresh})

    poison = {"vocab": group(1, vocab=5000, k=8), "narrow top-k": group(2, vocab=260, k=3)}
    extra = [group(seed, vocab=260, k=3) for seed in (3, 4, 5)]  # with the narrow one: one more step's worth
    with RedisBus(plan.settings.bus) as bus:
        for g in [*poison.values(), *extra]:
            assert bus.publish_group(g.group_id, encode_group(g))
        learner = stack.procs["learner"]
        wait("the learner to finish", lambda: learner.poll() is not None, plan.run_dir)
        assert learner.returncode == 0, "a poison group must not take the learner down"
        reasons = {d.item_id: d.reason for d in bus.dead_letters()}
    assert "declares vocab_size 5000, the learner's model has 260" in reasons[poison["vocab"].group_id]
    assert poison["narrow top-k"].group_id not in reasons  # a narrower top-k is padded and trains
    published = set(published_group_ids(plan.settings)) - {poison["vocab"].group_id}
    assert_exactly_once(plan, STEPS + 1, groups=published)
