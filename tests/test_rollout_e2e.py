"""The rollout fleet end to end, for real: a private redis-server, the reward service over HTTP and two
rollout worker processes, started by the product's launcher from resolved configs (no learner, no feeder:
the test feeds the prompts and reads the trajectory stream itself, with XRANGE, so no consumer group's
state is touched by the observer)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis
from _tiny import tiny_model_dir  # noqa: F401  (pytest fixture)

from sparkrl.launcher import Stack, StackPlan, logtail_bytes, plan_stack, write_configs
from sparkrl.proto import Prompt, TrajectoryGroup, decode_group, group_id_for
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.feeder import feed_prompts
from sparkrl.services.common.settings import PromptSettings, load_settings
from sparkrl.services.common.tasks.countdown import score_countdown
from sparkrl.services.common.tasks.datasets import countdown_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORKERS = ("worker-0", "worker-1")
PROMPT_COUNT = 16
LOGPROB_ATOL = 1e-5  # the sampled token's log-prob and the top-k row come from one float32 log-softmax
# ... and the top-k row travels in float16 (rollout.wire.topk_logprobs' default): rounded to nearest
TOPK_RTOL = 2.0**-11


@pytest.fixture(autouse=True)
def _no_sparkrl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # load_settings lets SPARKRL_* override the preset; the stack must run exactly what the test asks.
    for key in [k for k in os.environ if k.startswith("SPARKRL_")]:
        monkeypatch.delenv(key)


@dataclass
class Fleet:
    """A started stack (redis, reward, two workers) and the test's own handles on its bus."""

    plan: StackPlan
    stack: Stack
    bus: RedisBus
    client: redis.Redis  # plain client: XRANGE / XLEN / XPENDING never change a group's state

    @property
    def prompts_key(self) -> str:
        return self.bus.stream_key("prompts")

    @property
    def groups_key(self) -> str:
        return self.bus.stream_key("trajectories")

    def logs(self) -> str:
        """Exit state and log tail of every worker (and the reward service), for failure messages."""
        parts = []
        for name in ("reward", *WORKERS):
            proc = self.stack.procs.get(name)
            state = "not started" if proc is None else f"exit code {proc.poll()}"
            log_path = self.plan.run_dir / "logs" / f"{name}.log"
            parts.append(f"--- {name} ({state}), {log_path}:\n{logtail_bytes(log_path, lines=25)}")
        return "\n".join(parts)

    def wait(
        self, what: str, condition: Callable[[], bool], timeout_s: float, alive: tuple[str, ...]
    ) -> None:
        """Poll `condition` until true; fail with the logs on timeout or if a worker in `alive` died."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            dead = [name for name in alive if self.stack.procs[name].poll() is not None]
            if dead:
                pytest.fail(f"{', '.join(dead)} died while waiting for {what}\n{self.logs()}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{self.logs()}")
            time.sleep(0.05)

    def groups(self) -> list[tuple[str, TrajectoryGroup]]:
        """(published id, decoded group) of every entry on the trajectory stream, in stream order."""
        rows = self.client.xrange(self.groups_key)
        return [(fields[b"id"].decode(), decode_group(fields[b"payload"])) for _, fields in rows]

    def group_ids(self) -> list[str]:
        return [fields[b"id"].decode() for _, fields in self.client.xrange(self.groups_key)]

    def pending_of(self, consumer: str) -> list[str]:
        """Prompt-stream entry ids delivered to `consumer` and not acknowledged."""
        rows = self.client.xpending_range(
            self.prompts_key, self.bus.groups["prompts"], min="-", max="+", count=1000, consumername=consumer
        )
        return [row["message_id"].decode() for row in rows]

    def prompt_id_of(self, entry_id: str) -> str:
        ((_, fields),) = self.client.xrange(self.prompts_key, min=entry_id, max=entry_id)
        return fields[b"id"].decode()


@contextlib.contextmanager
def fleet(run_dir: Path, model_dir: Path, *overrides: str) -> Iterator[Fleet]:
    """Smoke preset + overrides; redis, reward and both workers started; everything stopped afterwards."""
    cfg = load_settings("smoke", [f"model={model_dir}", f"run_dir={run_dir}", *overrides])
    plan = plan_stack(cfg, workers=len(WORKERS), private_redis=True)
    write_configs(plan)
    stack = Stack(plan, services=["redis", "reward", *WORKERS], grace_s=10.0)
    with contextlib.ExitStack() as closing:
        closing.callback(stack.shutdown)  # runs last: after the clients below are closed
        stack.start()
        bus = closing.enter_context(RedisBus(plan.settings.bus))
        client = redis.Redis.from_url(plan.settings.bus.url, socket_timeout=5)
        closing.callback(client.close)
        running = Fleet(plan, stack, bus, client)
        # Feed only once both workers are up, or the first to load its model could take every prompt.
        running.wait(
            "both workers' first heartbeat",
            lambda: set(WORKERS) <= bus.statuses("worker").keys(),
            timeout_s=60,
            alive=WORKERS,
        )
        yield running


def feed(running: Fleet, seed: int) -> list[Prompt]:
    prompts = list(countdown_prompts(PromptSettings(task="countdown", count=PROMPT_COUNT, seed=seed)))
    report = feed_prompts(running.bus, prompts)
    assert (report.published, report.duplicates) == (PROMPT_COUNT, 0)
    return prompts


def assert_all_acknowledged(running: Fleet, alive: tuple[str, ...]) -> None:
    # The last group becomes visible just before its prompt's ack: give the ack a moment, no more.
    running.wait(
        "every prompt to be acknowledged (prompt stream empty, nothing pending in group 'rollout')",
        lambda: (
            running.client.xlen(running.prompts_key) == 0 and running.bus.pending_info("prompts").pending == 0
        ),
        timeout_s=10,
        alive=alive,
    )
    assert running.bus.pending_info("prompts") == (0, 0)


def assert_token_records_consistent(group: TrajectoryGroup) -> None:
    """Top-k rows sorted descending; a sampled token in its row has that row's log-prob, one outside it
    is no likelier than the row's last (k-th) entry, hence than the top-1."""
    for index, completion in enumerate(group.completions):
        where = f"group {group.group_id} completion {index}"
        topk_ids, topk_logprobs = completion.topk_ids, completion.topk_logprobs  # [T, k]
        assert topk_ids.shape == (completion.num_tokens, group.topk), where
        assert np.all(np.diff(topk_logprobs, axis=1) <= 0), f"{where}: top-k not sorted descending"
        hits = topk_ids == completion.token_ids[:, None]  # [T, k]
        in_topk = hits.any(axis=1)  # [T]
        np.testing.assert_allclose(
            completion.logprobs[in_topk],
            topk_logprobs[hits],  # one hit per row: ids within a row are distinct
            rtol=TOPK_RTOL,
            atol=LOGPROB_ATOL,
            err_msg=f"{where}: sampled log-prob differs from its top-k entry",
        )
        outside = ~in_topk
        slack = LOGPROB_ATOL + TOPK_RTOL * np.abs(topk_logprobs)
        assert np.all(completion.logprobs[outside] <= topk_logprobs[outside, -1] + slack[outside, -1]), where
        assert np.all(completion.logprobs <= topk_logprobs[:, 0] + slack[:, 0]), where


def test_two_workers_turn_16_prompts_into_16_groups(tmp_path: Path, tiny_model_dir: Path) -> None:  # noqa: F811
    with fleet(tmp_path / "run", tiny_model_dir) as running:
        sampling = running.plan.settings.rollout.sampling
        prompts = feed(running, seed=11)
        running.wait(
            f"{PROMPT_COUNT} groups on the trajectory stream",
            lambda: running.client.xlen(running.groups_key) >= PROMPT_COUNT,
            timeout_s=60,
            alive=WORKERS,
        )
        assert_all_acknowledged(running, alive=WORKERS)
        groups = running.groups()

    by_prompt = {p.prompt_id: p for p in prompts}
    assert len(groups) == PROMPT_COUNT
    assert sorted(gid for gid, _ in groups) == sorted(group_id_for(p.prompt_id) for p in prompts)
    producers: dict[str, int] = {}
    for published_id, group in groups:
        assert group.group_id == published_id
        prompt = by_prompt[group.prompt.prompt_id]
        assert group.group_id == group_id_for(prompt.prompt_id)
        assert group.prompt == prompt  # the worker carried the prompt unchanged
        assert len(group.completions) == sampling.n
        assert group.topk == sampling.topk_logprobs
        assert all(1 <= c.num_tokens <= sampling.max_new_tokens for c in group.completions)
        assert_token_records_consistent(group)
        numbers, target = prompt.task_data["numbers"], prompt.task_data["target"]
        expected = [score_countdown(c.text, numbers, target)[0] for c in group.completions]
        assert group.rewards == expected, f"{group.group_id}: {[c.text for c in group.completions]}"
        assert [d.score for d in group.reward_details] == expected
        producers[group.producer] = producers.get(group.producer, 0) + 1
    # Both workers were reading before the first prompt arrived and take 2 prompts a batch: both get some.
    assert set(producers) == set(WORKERS), producers


def _stop_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def freeze_if_holding(running: Fleet, name: str, within_s: float) -> bool:
    """SIGSTOP `name` at a moment it holds unacknowledged prompts; False if it held none within `within_s`.

    Frozen, it can neither ack nor touch, so what XPENDING shows for it stays put: the kill that follows
    lands while it holds prompts, not just after it happened to finish its batch.
    """
    proc = running.stack.procs[name]
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not running.pending_of(name):
            time.sleep(0.002)
            continue
        os.kill(proc.pid, signal.SIGSTOP)
        while (state := _stop_state(proc.pid)) != "T":  # kill() returns before the target has stopped
            if state in "ZX":
                pytest.fail(f"{name} died before it could be frozen\n{running.logs()}")
            time.sleep(0.001)
        if running.pending_of(name):
            return True
        os.kill(proc.pid, signal.SIGCONT)
    return False


@dataclass(frozen=True)
class Death:
    """What a killed worker left behind, seen right after it died."""

    held_prompt_ids: frozenset[str]  # delivered to it, never acknowledged
    published_group_ids: frozenset[str]  # the trajectory stream at that moment


def kill_and_inspect(running: Fleet, name: str) -> Death:
    victim = running.stack.procs[name]
    os.killpg(victim.pid, signal.SIGKILL)  # its own session: the group is exactly the worker
    victim.wait(timeout=10)
    # A request it sent just before it froze (a read, a publish, an ack) may land after the kill: take the
    # post-mortem picture once it has, and long before claim_idle_ms lets another worker reclaim anything.
    time.sleep(0.3)
    held = running.pending_of(name)
    return Death(
        held_prompt_ids=frozenset(running.prompt_id_of(entry_id) for entry_id in held),
        published_group_ids=frozenset(running.group_ids()),
    )


def feed_and_kill_while_holding(running: Fleet, name: str, prompts: list[Prompt]) -> Death:
    """Feed one prompt at a time until `name` is caught holding one: freeze it, SIGKILL it, feed the rest.

    A worker finishes a small batch in well under a second, so feeding everything and then trying to catch
    it can find all the work done; fed one by one, it is watched while it has work.
    """
    death = None
    for prompt in prompts:
        report = feed_prompts(running.bus, [prompt])
        assert (report.published, report.duplicates) == (1, 0)
        if death is None and freeze_if_holding(running, name, within_s=0.5):
            death = kill_and_inspect(running, name)
    if death is None:
        pytest.fail(f"{name} was never seen holding a prompt\n{running.logs()}")
    return death


def test_a_killed_workers_prompts_are_reclaimed(tmp_path: Path, tiny_model_dir: Path) -> None:  # noqa: F811
    claim_idle_ms = 3000
    overrides = (
        f"bus.claim_idle_ms={claim_idle_ms}",
        "rollout.prompts_per_batch=4",
        "rollout.sampling.n=8",
        "rollout.sampling.max_new_tokens=64",
    )
    with fleet(tmp_path / "run", tiny_model_dir, *overrides) as running:
        prompts = list(countdown_prompts(PromptSettings(task="countdown", count=PROMPT_COUNT, seed=12)))
        death = feed_and_kill_while_holding(running, "worker-0", prompts)
        assert death.held_prompt_ids, f"worker-0 held no prompt when killed\n{running.logs()}"

        running.wait(
            f"{PROMPT_COUNT} groups on the trajectory stream after worker-0 was killed",
            lambda: running.client.xlen(running.groups_key) >= PROMPT_COUNT,
            timeout_s=60,
            alive=("worker-1",),
        )
        assert_all_acknowledged(running, alive=("worker-1",))
        assert running.pending_of("worker-0") == []
        groups = running.groups()

    ids = [gid for gid, _ in groups]
    assert len(ids) == PROMPT_COUNT and len(set(ids)) == PROMPT_COUNT, f"duplicate group ids: {ids}"
    assert set(ids) == {group_id_for(p.prompt_id) for p in prompts}
    producer = {gid: group.producer for gid, group in groups}
    # Prompts whose group worker-0 published before dying but never acked are legitimately worker-0's.
    reclaimed = {group_id_for(p) for p in death.held_prompt_ids} - death.published_group_ids
    assert reclaimed, f"every prompt worker-0 held ({sorted(death.held_prompt_ids)}) was already published"
    assert {producer[gid] for gid in reclaimed} == {"worker-1"}, {gid: producer[gid] for gid in reclaimed}
