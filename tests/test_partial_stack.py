"""Partial rollouts on the real stack (private redis-server, the reward service, two torch-engine workers,
the DeepSpeed learner, loopback only): a worker stopped mid-generation (SIGTERM, as `sparkrl up` or a
scale-down stops one) hands its unfinished groups over, the other worker continues their samples from the
saved tokens instead of from the prompts, and every group is trained exactly once.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from _faults import assert_exactly_once, settings, wait
from _stream_follower import StreamFollower
from _tiny import babbling_model_dir, tiny_model_dir  # noqa: F401  (fixtures)
from conftest import start_stack
from test_vllm_up import vllm_settings

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.plan import StackPlan
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import SparkSettings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS, PER_STEP, T, T_VLLM = 12, 4, 96, 192
HANDED = re.compile(r"handed (\d+) groups over \((\d+) samples unfinished; (\d+) prompts released\): (.*)")
CONTINUED = re.compile(r"continuing (\d+) samples of (\d+) groups from saved partial work \((\d+) made again")


def test_a_stopped_workers_unfinished_groups_are_continued_by_another_and_trained_once(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    cfg = settings(
        tiny_model_dir,
        tmp_path / "run",
        f"rollout.sampling.max_new_tokens={T}",  # generation is most of a batch's time: a stop lands in it
        f"rollout.sampling.min_new_tokens={T}",  # and no sample has ended when it does
        f"prompts.count={PROMPTS}",
        f"learner.prompts_per_step={PER_STEP}",
        "learner.max_steps=100",  # the data ends the run
        "learner.checkpoint_every=100",
    )
    handed_over_and_continued(cfg, stacks, T, after_s=1.0)


def test_a_stopped_vllm_workers_unfinished_groups_are_continued_by_another(
    babbling_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """The same with two vLLM workers (its CPU build, .venv-vllm): a continued sample is a request of the
    prompt and the tokens so far. vLLM refuses min_new_tokens: the babbling model's completions run to the
    cap instead."""
    cfg = vllm_settings(
        babbling_model_dir,
        tmp_path / "run",
        100,  # the data ends the run
        f"rollout.sampling.max_new_tokens={T_VLLM}",
        "rollout.prompts_per_batch=4",
        f"prompts.count={PROMPTS}",
        "learner.checkpoint_every=100",
    )
    handed_over_and_continued(cfg, stacks, T_VLLM, after_s=0.5)


def handed_over_and_continued(cfg: SparkSettings, stacks: list[Stack], T: int, after_s: float) -> None:
    """Two workers; worker-0 is stopped (SIGTERM) `after_s` into generating: its groups are handed over,
    worker-1 continues every sample (none from scratch, counted), every group is trained once, and each
    continued sample runs to T tokens."""
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    follower = StreamFollower(plan.settings.bus)
    follower.start()
    with RedisBus(plan.settings.bus) as bus:
        wait(
            "worker-0 generating",
            lambda: '"generating"' in (bus.status("worker", "worker-0") or ""),
            plan.run_dir,
        )
    time.sleep(after_s)  # past the prefill (reported up to a heartbeat late): its samples hold tokens
    os.killpg(stack.procs["worker-0"].pid, signal.SIGTERM)  # as `sparkrl up` or a scale-down stops one
    assert stack.procs["worker-0"].wait(30) == 0
    learner = stack.procs["learner"]
    wait("the data to run out", lambda: learner.poll() is not None, plan.run_dir, timeout_s=400)
    groups = follower.stop()
    assert learner.returncode == 0, (plan.run_dir / "logs" / "learner.log").read_text()[-3000:]
    assert_exactly_once(plan, PROMPTS // PER_STEP)  # every group trained once: none lost, none twice

    log = worker_log(plan, "worker-0")
    found = HANDED.search(log)
    assert found, f"worker-0 handed nothing over:\n{log[-2000:]}"
    count, unfinished, released, handed = found.groups()
    assert int(count) == len(handed.split()) == int(released) > 0 and int(unfinished) > 0
    by_id = {g.group_id: g for g in groups}
    continued = [by_id[gid] for gid in handed.split()]  # every group handed over was published, once
    assert all(g.producer == "worker-1" and g.resumed_from == "worker-0" for g in continued)
    # None made again from scratch, counted twice: in the groups, and by the worker that took them up.
    from_scratch = sum(r == 0 for g in continued for r in g.resumed_tokens or [0] * len(g.completions))
    assert from_scratch == 0
    taken_up = [tuple(int(x) for x in m.groups()) for m in CONTINUED.finditer(worker_log(plan, "worker-1"))]
    assert sum(samples for samples, _, _ in taken_up) == sum(len(g.completions) for g in continued)
    assert sum(again for _, _, again in taken_up) == 0
    for group in continued:
        for c, resumed in zip(group.completions, group.resumed_tokens or [], strict=True):
            assert c.num_tokens == T and 0 < resumed < T  # continued from where worker-0 stopped
    # Nothing else was continued; the rest was made from the prompt, as without partial rollouts.
    assert {g.group_id for g in groups if g.resumed_from is not None} == set(handed.split())


def worker_log(plan: StackPlan, worker: str) -> str:
    return (plan.run_dir / "logs" / f"{worker}.log").read_text()
