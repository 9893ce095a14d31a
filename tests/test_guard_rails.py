"""Guard rails on what reaches the model (issue 20): a step whose loss or gradient norm is not finite is
never applied, and `learner.max_nonfinite_steps` of them in a row stop the run with a true reason; the
weights stay finite and nothing non-finite is published. Real DeepSpeed (gloo, one process), a private
redis-server and the real learner loop; the live test runs `sparkrl up`'s whole stack and talks HTTP.

No product part is replaced: the non-finite numbers come from data (a group whose finite rollout
log-probs are far out of range: the importance ratio overflows) or from a model whose finite weights
overflow its forward (what a diverged run leaves behind).
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import redis as redis_lib
import torch
from _faults import assert_exactly_once, published_group_ids, steps_done, wait
from _faults import settings as stack_settings
from _learner import learner_loop, one_rank, settings
from _live import Live
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import start_stack
from safetensors.torch import load_file

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.proto import ControlCommand, SetHparamsCommand, TrajectoryGroup, encode_group, encode_message
from sparkrl.proto.testing import random_group
from sparkrl.run_report import summarize
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.control_channel import CONTROL_LOG
from sparkrl.services.common.modeling import load_model, load_tokenizer
from sparkrl.services.common.settings import BusSettings
from sparkrl.services.learner.checkpoint import nonfinite_tensors
from sparkrl.services.learner.guard import NOT_FINITE_ALONE
from sparkrl.services.learner.learner import Learner
from sparkrl.services.learner.ledger import Batch

VOCAB = 260  # the tiny model's
FAR_OUT = -1e30  # a finite log-prob (the wire takes it), so far out that exp(logp − old_logp) overflows


def group(seed: int, logprob: float | None = None) -> TrajectoryGroup:
    """A well-formed group sampled by the initial weights; `logprob`: every rollout log-prob set to it."""
    g = random_group(np.random.default_rng(seed), n=4, T=6, k=8, vocab_size=VOCAB, max_new_tokens=16)
    completions = [
        c.model_copy(
            update={
                "policy_versions": np.zeros_like(c.policy_versions),
                "logprobs": c.logprobs if logprob is None else np.full_like(c.logprobs, logprob),
            }
        )
        for c in g.completions
    ]
    update = {
        "prompt_token_ids": g.prompt_token_ids[:10],
        "rewards": [1.0, 0, 1, 0],
        "completions": completions,
    }
    return g.model_copy(update=update)


def publish(bus: RedisBus, *groups: TrajectoryGroup) -> None:
    for g in groups:
        assert bus.publish_group(g.group_id, encode_group(g))


def overflowing_model(tiny_model_dir: Path, out: Path) -> Path:  # noqa: F811
    """The tiny model with finite weights whose logits overflow to inf (so log-probs are NaN)."""
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(1e30)
        model.lm_head.weight.mul_(1e30)
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(tiny_model_dir).save_pretrained(out)
    return out


# ── one update on the real engine ────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(("zero_stage", "dtype"), [(0, "float32"), (2, "float32"), (2, "bfloat16")])
def test_an_update_whose_loss_is_not_finite_is_not_applied(
    zero_stage: int,
    dtype: str,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Plain torch AdamW (stage 0 in float32: dropped by the learner), ZeRO and the bf16 optimizer
    (dropped by DeepSpeed's own check): the weights do not move, and the gradients are gone: the next
    update is exactly the one a fresh engine takes."""
    overrides = [f"learner.zero_stage={zero_stage}", f"learner.dtype={dtype}", "learner.lr=1e-3"]
    cfg = settings(tiny_model_dir, tmp_path, *overrides)
    trainer = one_rank(cfg)
    before = trainer.weights()
    stats = trainer.update(Batch([group(1), group(2, logprob=FAR_OUT)], []), 1, cfg.learner).row()
    assert stats["updates_skipped"] == 1.0 and stats["updates"] == 0.0
    assert not math.isfinite(stats["skipped_loss"])
    after = trainer.weights()
    assert all(torch.equal(after[name], before[name]) for name in before), "a non-finite update was applied"

    stats = trainer.update(Batch([group(3)], []), 1, cfg.learner).row()
    assert "updates_skipped" not in stats and stats["updates"] == 1.0
    assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
    fresh = one_rank(cfg)
    fresh.update(Batch([group(3)], []), 1, cfg.learner)
    torch.testing.assert_close(trainer.weights(), fresh.weights(), rtol=0, atol=0)
    assert not nonfinite_tensors(trainer.weights())


# ── the learner loop ─────────────────────────────────────────────────────────────────────────────────


@pytest.fixture
def bus(bus_settings: BusSettings) -> Iterator[RedisBus]:
    with RedisBus(bus_settings) as bus:
        yield bus


@pytest.fixture
def make_learner(bus: RedisBus, tmp_path: Path) -> Iterator[Callable[[Path], Learner]]:
    """The learner's loop on a model directory, with real parts (engine, bus, control, reporting)."""
    with ExitStack() as made:

        def make(model_dir: Path) -> Learner:
            cfg = settings(model_dir, tmp_path, "learner.prompts_per_step=3")
            return made.enter_context(learner_loop(cfg, bus))

        yield make


def counter(learner: Learner, name: str) -> float:
    return float(learner.reports.metrics.registry.get_sample_value(name) or 0.0)


def test_a_group_whose_loss_alone_is_not_finite_is_dead_lettered_and_the_rest_trains(
    make_learner: Callable[[Path], Learner],
    bus: RedisBus,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    learner = make_learner(tiny_model_dir)
    good, poison = [group(10 + i) for i in range(2)], group(20, logprob=FAR_OUT)
    publish(bus, good[0], poison, good[1])
    before = learner.trainer.weights()
    batch = learner.collector.fill(0, learner.live.max_staleness, lambda: False)
    assert batch is not None and len(batch.groups) == 3
    assert learner.step(batch) is None, "a step with a non-finite loss must not be taken"
    assert learner.state.step == 0 and learner.guard.stop is None
    assert all(torch.equal(t, before[n]) for n, t in learner.trainer.weights().items())
    [letter] = bus.dead_letters()
    assert letter.item_id == poison.group_id and letter.reason == NOT_FINITE_ALONE
    # The good groups are first in line again, still pending: not burnt, not acknowledged.
    assert [g.group_id for g in learner.collector.groups] == [g.group_id for g in good]
    assert bus.pending_info("trajectories").pending == 2
    assert learner.guard.streak.count == 0  # the data's fault, not the model's
    assert counter(learner, "sparkrl_learner_nonfinite_skipped_total") == 1.0

    publish(bus, group(30))
    row = learner.step(learner.collector.fill(0, learner.live.max_staleness, lambda: False))
    assert row is not None and learner.state.step == 1
    assert row.value("loss/nonfinite_skipped_total") == 1.0 and math.isfinite(row.value("loss/value"))
    assert not nonfinite_tensors(learner.trainer.weights())


def test_steps_in_a_row_not_applied_stop_the_run_naming_the_last_change(
    make_learner: Callable[[Path], Learner],
    bus: RedisBus,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A model that overflows on everything: no group is to blame, so nothing is dead-lettered; after
    `learner.max_nonfinite_steps` (3) the loop ends, nothing applied, acknowledged or published."""
    learner = make_learner(overflowing_model(tiny_model_dir, tmp_path / "diverged"))
    # What the control service does with `PATCH {"lr": 0.05}`: a command on the control stream.
    body = SetHparamsCommand(command="set_hparams", values={"lr": 0.05})
    command = ControlCommand(command_id="lr", issued_at=time.time(), body=body)
    bus.logs.append(CONTROL_LOG, encode_message(command))
    groups = [group(40 + i) for i in range(12)]
    publish(bus, *groups)
    deadline = threading.Timer(120, learner.stop.set)  # the loop should stop long before
    deadline.start()
    learner.run()
    deadline.cancel()
    stop = learner.guard.stop
    assert stop is not None and stop.startswith("3 steps in a row had a loss or gradient norm that is not")
    assert "lr=0.05 (at step 0)" in stop and "a resume trains with the configured values" in stop
    assert "lr" not in learner.control.overrides  # the final checkpoint does not keep the suspect
    assert (learner.state.step, learner.state.policy_version, learner.state.nonfinite_skipped) == (0, 0, 3)
    assert bus.dead_letters() == []
    assert bus.pending_info("trajectories").pending == len(groups)  # none burnt
    assert counter(learner, "sparkrl_learner_nonfinite_in_a_row") == 3.0
    assert not (tmp_path / "metrics.jsonl").read_text()  # no step row: no step was taken


# ── the live stack ───────────────────────────────────────────────────────────────────────────────────

STEPS, PER_STEP = 8, 4


def _live(plan, stack: Stack) -> Live:  # type: ignore[no-untyped-def]
    return Live(plan, stack, plan.settings.control.url, plan.token_path.read_text().strip())


@pytest.mark.slow
def test_on_the_live_stack_a_huge_lr_is_refused_and_a_non_finite_step_burns_nothing(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """`PATCH lr=1e9` mid-run: 422 with the reason, nothing sent. Then a group whose loss overflows
    reaches the learner through the bus, as a worker's would: its step is not applied, the group is
    dead-lettered, the others train; the weights and every published snapshot stay finite, and the run
    reaches its last step with every other group trained exactly once."""
    cfg = stack_settings(
        tiny_model_dir,
        tmp_path / "run",
        f"learner.max_steps={STEPS}",
        f"learner.prompts_per_step={PER_STEP}",
        "learner.checkpoint_every=4",
        f"prompts.count={STEPS * PER_STEP}",
    )
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    live = _live(plan, stack)
    wait("step 2", lambda: steps_done(plan.run_dir) >= 2, plan.run_dir)

    refused = live.send("PATCH", "/api/v1/hyperparameters", {"lr": 1e9})
    assert refused.status_code == 422, refused.text
    [error] = refused.json()["detail"]
    assert error["loc"] == ["body", "lr"]
    assert error["msg"].startswith("lr must be ≤ 0.1: Adam moves every weight by about lr per step")
    assert live.get("/api/v1/status")["hyperparameters"]["lr"] == pytest.approx(1e-4)  # nothing changed

    poison = group(7, logprob=FAR_OUT)
    with RedisBus(plan.settings.bus) as bus:
        publish(bus, poison)
        learner = stack.procs["learner"]
        wait("the learner to finish", lambda: learner.poll() is not None, plan.run_dir, timeout_s=300)
        assert learner.returncode == 0
        reasons = {d.item_id: d.reason for d in bus.dead_letters()}
    assert reasons == {poison.group_id: NOT_FINITE_ALONE}
    assert_exactly_once(plan, STEPS, groups=published_group_ids(plan.settings) - {poison.group_id})
    rows = [json.loads(line) for line in (plan.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["metrics"]["loss/nonfinite_skipped_total"] == 1.0
    assert all(math.isfinite(r["metrics"]["loss/value"]) for r in rows)
    log = (plan.run_dir / "logs" / "learner.log").read_text()
    assert "not finite, the update is not applied" in log
    # What the workers were sent (the snapshot every broadcast serves) and what was saved: finite.
    for weights in (*(plan.run_dir / "snapshots").rglob("*.safetensors"),
                    *(plan.run_dir / "checkpoints").rglob("*.safetensors")):  # fmt: skip
        assert not nonfinite_tensors(load_file(weights)), weights
    assert (
        json.loads((plan.run_dir / "ended.json").read_text())["reason"]
        == f"learner.max_steps ({STEPS}) reached"
    )


@pytest.mark.slow
def test_a_learner_whose_model_overflows_stops_with_a_true_reason_and_burns_nothing(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """The learner process alone on a private Redis, its model's forward overflowing, fed groups through
    the bus: three steps not applied, then it exits non-zero, `ended.json` and the summary say why, every
    group is still pending for a resume, and no version past the initial one was announced."""
    model = overflowing_model(tiny_model_dir, tmp_path / "diverged")
    cfg = stack_settings(model, tmp_path / "run", "learner.prompts_per_step=3", "learner.max_steps=10")
    plan = plan_stack(cfg, workers=1, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, services=["redis", "learner"], ready_timeout_s=180))
    groups = [group(60 + i) for i in range(12)]
    with RedisBus(plan.settings.bus) as bus:
        publish(bus, *groups)
        learner = stack.procs["learner"]
        wait("the learner to stop", lambda: learner.poll() is not None, plan.run_dir)
        assert learner.returncode != 0
        client = redis_lib.Redis.from_url(plan.settings.bus.url)
        assert client.xlen(bus.stream_key("trajectories")) == len(groups), "a group was acknowledged"
        client.close()
        assert bus.dead_letters() == []
    ended = json.loads((plan.run_dir / "ended.json").read_text())
    assert ended["step"] == 0 and ended["reason"].startswith("3 steps in a row had a loss or gradient norm")
    assert "no hyperparameter was changed live" in ended["reason"]
    assert "3 steps in a row had a loss or gradient norm" in summarize(plan.run_dir)
    syncs = (plan.run_dir / "weights.jsonl").read_text().splitlines()
    assert all(json.loads(line)["version"] == 0 for line in syncs)
    shutil.rmtree(model)
