"""The learner's side of the control plane with a real DeepSpeed engine and a private redis-server:
commands off the control stream, applied at a boundary as new settings, answered; the learning rate
reaches the optimizer through the update (plain and ZeRO), not before; live changes carried by a
checkpoint are re-applied on resume."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from _tiny import tiny_model_dir  # noqa: F401  (fixture)

from sparkrl.proto import (
    CheckpointCommand,
    CommandResult,
    ControlBody,
    ControlCommand,
    ControlState,
    PauseCommand,
    ResumeCommand,
    SetHparamsCommand,
    StopCommand,
    TrajectoryGroup,
    encode_message,
)
from sparkrl.proto.testing import random_group
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.bus.logs import START
from sparkrl.services.common.control_channel import CONTROL_LOG, CONTROL_STATE_KEY, ControlReader
from sparkrl.services.common.modeling import load_model
from sparkrl.services.common.settings import BusSettings, load_settings
from sparkrl.services.common.telemetry import LEARNER, Telemetry
from sparkrl.services.learner.control import LearnerControl, hparams_in_force, resumed
from sparkrl.services.learner.trainer import build_engine, init_distributed
from sparkrl.services.learner.update import run_updates


def send(bus: RedisBus, command_id: str, body: ControlBody) -> None:
    """What the control service does: append the command to the control stream."""
    command = ControlCommand(command_id=command_id, issued_at=time.time(), body=body)
    bus.logs.append(CONTROL_LOG, encode_message(command))


def results(telemetry: Telemetry) -> dict[str, CommandResult]:
    return {e.message.command_id: e.message for e in telemetry.follow({"commands": START}, block_ms=None)}


def a_group() -> TrajectoryGroup:
    """One group the tiny model (a vocabulary of 260) trains on, with signal."""
    group = random_group(np.random.default_rng(0), n=2, T=4, k=8, vocab_size=260)
    return group.model_copy(update={"prompt_token_ids": group.prompt_token_ids[:8], "rewards": [1.0, 0.0]})


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_commands_at_a_boundary(
    zero_stage: int,
    tiny_model_dir: Path,  # noqa: F811
    bus_settings: BusSettings,
) -> None:
    cfg = load_settings("smoke", [f"learner.zero_stage={zero_stage}", "learner.lr=1e-4"]).learner
    init_distributed(cfg)
    engine = build_engine(load_model(tiny_model_dir), cfg)
    bus = RedisBus(bus_settings)
    telemetry = Telemetry(bus)
    answered: list[CommandResult] = []
    control = LearnerControl(ControlReader(bus, telemetry, LEARNER), {}, answered.append)
    assert not control.paused and not control.pending()

    send(bus, "p", PauseCommand(command="pause"))
    send(bus, "h", SetHparamsCommand(command="set_hparams", values={"lr": 3e-4, "beta": 0.25, "top_p": 0.9}))
    send(bus, "bad", SetHparamsCommand(command="set_hparams", values={"lr": 1e-2, "beta": -1.0}))
    send(bus, "w", SetHparamsCommand(command="set_hparams", values={"temperature": 0.5}))  # workers only
    send(bus, "c", CheckpointCommand(command="checkpoint", tag="t1"))
    assert control.pending()
    todo = control.boundary(step=7, live=cfg)
    assert control.paused and [c.command_id for c in todo.checkpoints] == ["c"] and todo.stop is None
    got = results(telemetry)
    assert set(got) == {"p", "h", "bad"}  # the workers-only change is not the learner's to answer
    assert got["p"].detail == "paused at step 7" and got["p"].step == 7
    assert got["h"].outcome == "applied" and got["h"].values == {"lr": 3e-4, "beta": 0.25}
    assert (
        got["bad"].outcome == "rejected" and "beta: beta must be ≥ 0: a negative weight" in got["bad"].detail
    )
    live = todo.live
    assert live.lr == 3e-4 and live.loss.beta == 0.25  # the rejected lr=1e-2 changed nothing
    assert cfg.lr == 1e-4 and cfg.loss.beta == 1.0  # new settings: the configured ones stay as they were
    assert engine.get_lr() == [1e-4]  # the boundary leaves the optimizer alone: the next update sets it
    run_updates(engine, [a_group()], live, 0, step=8)  # the next step's update
    assert engine.get_lr() == [3e-4]
    in_force = hparams_in_force(engine.get_lr()[0], live)
    assert in_force["lr"] == 3e-4 and in_force["beta"] == 0.25 and in_force["loss"] == "lp_reg"
    assert control.overrides == {"lr": 3e-4, "beta": 0.25}
    assert [r.command_id for r in answered] == ["p", "h", "bad"]

    send(bus, "r", ResumeCommand(command="resume"))
    send(bus, "s", StopCommand(command="stop", checkpoint=False))
    todo = control.boundary(step=8, live=live)
    assert todo.live is live  # nothing changed: the same settings
    assert not control.paused and todo.stop is not None and not todo.stop.body.checkpoint
    assert results(telemetry)["r"].detail == "resumed at step 8"
    bus.close()


def test_a_restart_adopts_the_fleet_state_and_the_checkpointed_changes(
    tiny_model_dir: Path,  # noqa: F811
    bus_settings: BusSettings,
) -> None:
    cfg = load_settings("smoke", ["learner.lr=1e-4"]).learner
    init_distributed(cfg)
    engine = build_engine(load_model(tiny_model_dir), cfg)
    bus = RedisBus(bus_settings)
    bus.set_value(CONTROL_STATE_KEY, encode_message(ControlState(paused=True, updated_at=1.0)))
    send(bus, "old", PauseCommand(command="pause"))  # issued before the restart: not replayed
    overrides = {"lr": 5e-4, "beta": 0.3, "entropy_coef": 0.1}  # the last no longer fits the loss
    live, carried = resumed(cfg, overrides)
    control = LearnerControl(ControlReader(bus, Telemetry(bus), LEARNER), carried, lambda r: None)
    assert control.paused, "the fleet is paused: a restarted learner must not train"
    assert live.lr == 5e-4 and live.loss.beta == 0.3
    run_updates(engine, [a_group()], live, 0, step=1)
    assert engine.get_lr() == [5e-4]
    assert control.overrides == {"lr": 5e-4, "beta": 0.3}
    assert not control.pending()
    bus.close()
