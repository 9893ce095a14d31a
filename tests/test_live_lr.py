"""A live learning-rate change on the real learner loop (real DeepSpeed, gloo, one process; a private
redis-server; the command on the real control stream): it reaches the optimizer exactly once per step,
through the update, from the step after the boundary that applied it, and the step row reports the lr
that step used. The settings are a frozen value the boundary replaces: nothing else writes the lr."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from _learner import learner_loop, settings
from _tiny import tiny_model_dir  # noqa: F401  (fixture)

from sparkrl.proto import (
    ControlCommand,
    SetHparamsCommand,
    StepMetrics,
    TrajectoryGroup,
    encode_group,
    encode_message,
)
from sparkrl.proto.testing import random_group
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.bus.logs import START
from sparkrl.services.common.control_channel import CONTROL_LOG
from sparkrl.services.common.settings import BusSettings, LearnerSettings
from sparkrl.services.learner.ledger import Batch
from sparkrl.services.learner.stats import Updated
from sparkrl.services.learner.trainer import OneRank, Trainer

LR, NEW_LR, WARMUP, STEPS, CHANGED_AFTER = 1e-4, 3e-4, 4, 4, 2


def group(seed: int) -> TrajectoryGroup:
    """A group the tiny model (a vocabulary of 260) trains on, sampled by version 0, with signal."""
    g = random_group(np.random.default_rng(seed), n=4, T=6, k=8, vocab_size=260, max_new_tokens=16)
    versions = {"policy_versions": np.zeros_like(g.completions[0].policy_versions)}
    completions = [c.model_copy(update=versions) for c in g.completions]
    rewards = [1.0, 0.0, 1.0, 0.0]
    return g.model_copy(
        update={"prompt_token_ids": g.prompt_token_ids[:10], "rewards": rewards, "completions": completions}
    )


class CountedGroup(dict):  # type: ignore[type-arg]
    """One of the optimizer's param groups, recording each write of its lr (torch reads it as the dict
    it is): how many times, and where, the lr reaches the optimizer."""

    def __init__(self, group: dict, writes: list[float]) -> None:  # type: ignore[type-arg]
        super().__init__(group)
        self.writes = writes

    def __setitem__(self, key: str, value: object) -> None:
        if key == "lr":
            self.writes.append(float(value))  # type: ignore[arg-type]
        super().__setitem__(key, value)


@dataclass
class Update:
    """What one step's update saw."""

    step: int
    lr_settings: float  # the settings in force the loop handed it
    writes_before: int  # the lr writes so far when the update began (after the step boundary)
    writes: list[float]  # the lr writes during the update


@dataclass
class Watched:
    """The learner's own trainer, watched: each update's lr writes; after step `CHANGED_AFTER`'s update,
    `PATCH {"lr": NEW_LR}` as the control service sends it (a command on the control stream), so the
    next boundary applies it."""

    trainer: OneRank
    bus: RedisBus
    writes: list[float] = field(default_factory=list)
    updates: list[Update] = field(default_factory=list)

    def __post_init__(self) -> None:
        groups = self.trainer.engine.optimizer.param_groups
        groups[:] = [CountedGroup(g, self.writes) for g in groups]

    def __getattr__(self, name: str) -> object:
        return getattr(self.trainer, name)

    def update(self, batch: Batch, step: int, cfg: LearnerSettings) -> Updated:
        before = len(self.writes)
        done = self.trainer.update(batch, step, cfg)
        self.updates.append(Update(step, cfg.lr, before, self.writes[before:]))
        if step == CHANGED_AFTER:
            body = SetHparamsCommand(command="set_hparams", values={"lr": NEW_LR})
            command = ControlCommand(command_id="lr", issued_at=time.time(), body=body)
            self.bus.logs.append(CONTROL_LOG, encode_message(command))
        return done


@pytest.fixture
def bus(bus_settings: BusSettings) -> Iterator[RedisBus]:
    with RedisBus(bus_settings) as bus:
        yield bus


def test_a_live_lr_reaches_the_optimizer_once_per_step_from_the_next_boundary(
    tiny_model_dir: Path,  # noqa: F811
    bus: RedisBus,
    tmp_path: Path,
) -> None:
    # A warm-up, so each step's lr is the settings' lr × its own factor: a value written twice, or kept
    # from the boundary, would show.
    overrides = [f"learner.lr={LR}", f"learner.schedule.warmup_steps={WARMUP}", f"learner.max_steps={STEPS}"]
    overrides += ["learner.prompts_per_step=2", "learner.checkpoint_every=100"]
    cfg = settings(tiny_model_dir, tmp_path, *overrides)
    watched: list[Watched] = []

    def watch(trainer: Trainer) -> Trainer:
        assert isinstance(trainer, OneRank)
        watched.append(Watched(trainer, bus))
        return watched[0]  # type: ignore[return-value]  (the protocol's methods, by delegation)

    for g in (group(seed) for seed in range(2 * STEPS)):
        assert bus.publish_group(g.group_id, encode_group(g))
    with learner_loop(cfg, bus, trainer_as=watch) as learner:
        configured = learner.live
        deadline = threading.Timer(300, learner.stop.set)  # the loop ends at max_steps long before
        deadline.start()
        learner.run()
        deadline.cancel()
        assert learner.state.step == STEPS
        assert learner.live.lr == NEW_LR and configured.lr == LR  # replaced, not changed
        assert learner.control.overrides == {"lr": NEW_LR}  # the checkpoint carries it

    [w] = watched
    steps = range(1, STEPS + 1)
    want = [(LR if step <= CHANGED_AFTER else NEW_LR) * step / WARMUP for step in steps]  # × the warm-up
    assert [u.step for u in w.updates] == list(steps)
    assert [u.lr_settings for u in w.updates] == [LR, LR, NEW_LR, NEW_LR]  # from the next boundary on
    # Exactly one write of the lr per step, in its update, and none between: not at the boundary that
    # applied the change, nor anywhere else.
    assert [u.writes for u in w.updates] == [[pytest.approx(v)] for v in want]
    assert [u.writes_before for u in w.updates] == list(range(STEPS))
    assert len(w.writes) == STEPS
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [StepMetrics.model_validate_json(line) for line in lines]
    assert [row.step for row in rows] == list(steps)
    assert [row.hparams["lr"] for row in rows] == [pytest.approx(v) for v in want]  # what each step used
    answers = learner.reports.telemetry.follow({"commands": START}, block_ms=None)
    [answer] = [e.message for e in answers if e.message.command_id == "lr"]
    assert answer.outcome == "applied" and answer.detail == f"in force from step {CHANGED_AFTER + 1}"
