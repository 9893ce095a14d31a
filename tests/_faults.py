"""Helpers of the fault-injection tests: start the real stack, break a part, check the invariant.

The invariant, after the run (and any resume): every group published was trained exactly once or
filtered exactly once (`learner.filter_groups`: recorded, never trained), and the last checkpoint's
`trainer_state` agrees. "Trained on" is the run's current history: `trained_groups.jsonl` keeps every
step it did, including the ones a crash rolled back and the resume redid; for each step the last record
is the one the model reflects.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis as redis_lib

from sparkrl.launcher import Stack
from sparkrl.plan import StackPlan
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import SparkSettings, load_settings


def settings(model_dir: Path, run_dir: Path, *overrides: str) -> SparkSettings:
    return load_settings(
        "smoke",
        [
            f"model={model_dir}",
            f"run_dir={run_dir}",
            "learner.max_staleness=1000",  # nothing is dropped as stale: every published group is trained
            "bus.trajectory_maxlen=12",  # the workers stay close to the learner
            "bus.claim_idle_ms=2000",  # prompts of a dead worker come back quickly
            *overrides,
        ],
    )


def wait(what: str, condition: Callable[[], bool], run_dir: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(
                f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-20:])
                for log in sorted((run_dir / "logs").glob("*.log"))
            )
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{logs}")
        time.sleep(0.2)


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]
    return steps[-1] if steps else 0


def kill9(stack: Stack, name: str) -> None:
    os.killpg(stack.procs[name].pid, signal.SIGKILL)
    stack.procs[name].wait(10)


@dataclass(frozen=True)
class History:
    """The run's current history from its audit trail: step → group ids trained (the last record of each
    step), and the groups filtered (`filtered_groups.jsonl`: set aside as read, never trained)."""

    steps: dict[int, list[str]]
    records: int  # records in the file (more than steps when a resume redid some)
    filtered_ids: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, run_dir: Path) -> History:
        lines = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
        steps: dict[int, list[str]] = {}
        for record in lines:  # a later record of a step supersedes the one a crash rolled back
            steps[record["step"]] = record["group_ids"]
        trail = run_dir / "filtered_groups.jsonl"
        records = [json.loads(line) for line in trail.read_text().splitlines()] if trail.is_file() else []
        return cls(steps, len(lines), [gid for record in records for gid in record["group_ids"]])

    @property
    def group_ids(self) -> list[str]:
        return [gid for step in sorted(self.steps) for gid in self.steps[step]]


def published_group_ids(cfg: SparkSettings) -> set[str]:
    """Every group id the bus accepted (its dedup marks)."""
    client = redis_lib.Redis.from_url(cfg.bus.url)
    prefix = f"{cfg.bus.namespace}:published:trajectories:"
    ids = {key.decode()[len(prefix) :] for key in client.scan_iter(match=prefix + "*", count=1000)}
    client.close()
    return ids


def queued_group_ids(cfg: SparkSettings) -> set[str]:
    """The groups still in the trajectory stream (published, not yet trained), as audit_run.py reads them."""
    client = redis_lib.Redis.from_url(cfg.bus.url)
    entries = client.xrange(f"{cfg.bus.namespace}:trajectories")
    client.close()
    return {fields[b"id"].decode() for _, fields in entries}


def assert_exactly_once(
    plan: StackPlan, expected_steps: int, groups: set[str] | None = None, queued_ok: bool = False
) -> History:
    """The invariant; `groups`: the published set when the bus's marks cannot tell (it lost them);
    `queued_ok`: groups published after the learner's last batch may still wait in the stream (a fleet
    with prompts to spare outruns a learner that stops at max_steps), and only there."""
    history = History.read(plan.run_dir)
    assert sorted(history.steps) == list(range(1, expected_steps + 1)), "a step is missing from the history"
    trained, filtered = history.group_ids, history.filtered_ids
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert len(filtered) == len(set(filtered)), "a group was filtered twice"
    assert not set(trained) & set(filtered), "a group was both trained and filtered"
    used = set(trained) | set(filtered)
    published = groups if groups is not None else published_group_ids(plan.settings)
    if queued_ok:
        waiting = published - used
        assert waiting <= queued_group_ids(plan.settings), "a published group is neither trained nor queued"
        published -= waiting
    assert used == published, (
        f"trained {len(set(trained))} and filtered {len(filtered)} of {len(published)} published groups; "
        f"missing {sorted(published - used)[:5]}, extra {sorted(used - published)[:5]}"
    )
    latest = os.readlink(plan.run_dir / "checkpoints" / "latest")
    state = json.loads((plan.run_dir / "checkpoints" / latest / "trainer_state.json").read_text())
    assert (state["step"], state["groups_trained"]) == (expected_steps, len(trained))
    assert state["trained_group_ids"] == history.steps[expected_steps]
    return history


def pending_trajectories(cfg: SparkSettings) -> int:
    with RedisBus(cfg.bus) as bus:
        return bus.pending_info("trajectories").pending


def journal_ids(run_dir: Path) -> dict[int, list[str]]:
    """The group ids of every step the run's journal holds now (read it before a resume trims it)."""
    from sparkrl.proto import decode_group
    from sparkrl.services.learner.ledger import Journal

    if not (run_dir / "journal").is_dir():  # not made here: the run's own folders are the run's to make
        return {}
    journal = Journal(run_dir)
    return {step: [decode_group(e.payload).group_id for e in journal.read(step)] for step in journal.steps()}


def assert_each_group_once(history: History, journaled: dict[int, list[str]]) -> None:
    """The audit that counts both records: every step's groups as the journal holds them (as read, maybe
    before a resume trimmed it) and as the audit trail's last record of the step says, and every group id
    in exactly one step. A journaled step whose groups were trained again under another step (a step
    checkpointed without its commit, then its groups redelivered) fails here even when the trail lacks it."""
    for step, ids in journaled.items():
        if step in history.steps:
            assert history.steps[step] == ids, f"step {step}: the journal and the audit trail disagree"
    steps = history.steps | journaled
    where: dict[str, list[int]] = {}
    for step, ids in steps.items():
        for gid in ids:
            where.setdefault(gid, []).append(step)
    twice = {gid: found for gid, found in where.items() if len(found) > 1}
    assert not twice, f"{len(twice)} groups trained in more than one step, e.g. {sorted(twice.items())[:3]}"
