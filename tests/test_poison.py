"""No poison message stops training: groups the learner's model cannot take are dead-lettered alone before
they join a batch; a step that raises sends its groups back and dead-letters only the culprit; mixed top-k
widths train together; `sparkrl dead` lists and requeues. Real DeepSpeed, a private redis-server."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from _learner import learner_loop, settings
from _tiny import tiny_model_dir  # noqa: F401  (fixture)

from sparkrl.proto import TrajectoryGroup, encode_group
from sparkrl.proto.testing import random_group
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import BusSettings, LearnerSettings
from sparkrl.services.learner.batch import collate, samples_from_groups
from sparkrl.services.learner.learner import Learner
from sparkrl.services.learner.ledger import Batch
from sparkrl.services.learner.trainer import Trainer
from sparkrl.services.learner.validate import ModelLimits, group_problem

VOCAB = 260  # the tiny model's


def group(seed: int, vocab: int = VOCAB, k: int = 8, prompt_len: int = 10, T: int = 6) -> TrajectoryGroup:
    g = random_group(np.random.default_rng(seed), n=4, T=T, k=k, vocab_size=vocab, max_new_tokens=max(T, 16))
    prompt = np.resize(g.prompt_token_ids, prompt_len).astype(np.int32)  # exactly prompt_len tokens
    # Sampled by the initial weights, as a fresh learner's first groups are.
    completions = [
        c.model_copy(update={"policy_versions": np.zeros_like(c.policy_versions)}) for c in g.completions
    ]
    update = {"prompt_token_ids": prompt, "rewards": [1.0, 0, 1, 0], "completions": completions}
    return g.model_copy(update=update)


LIMITS = ModelLimits(vocab_size=VOCAB, max_len=64, needs_topk=True)


def test_what_the_model_cannot_take_is_named() -> None:
    assert group_problem(group(0), LIMITS) is None
    assert "declares vocab_size 1000, the learner's model has 260" in group_problem(
        group(1, vocab=1000), LIMITS
    )
    long = group(2, prompt_len=60, T=16)
    assert "exceeds the model's context of 64 positions" in group_problem(long, LIMITS)
    assert "carries no top-k" in group_problem(group(3, k=0), LIMITS)
    assert group_problem(group(3, k=0), ModelLimits(VOCAB, 64, needs_topk=False)) is None


def test_mixed_topk_widths_collate_padded_below_any_real_logprob() -> None:
    samples = samples_from_groups([group(4, k=8), group(5, k=3)])
    mb = collate(samples, pad_id=0)
    assert mb.topk_ids.shape[-1] == 8
    narrow = next(i for i, s in enumerate(samples) if s.topk_ids.shape[-1] == 3)
    targets = mb.topk_logp[narrow][mb.mask[narrow]]  # [T, 8] at the generated positions
    torch.testing.assert_close(targets[:, :3], samples[narrow].topk_logp)
    assert (targets[:, 3:] == -1e4).all()


@pytest.fixture
def bus(bus_settings: BusSettings) -> Iterator[RedisBus]:
    with RedisBus(bus_settings) as bus:
        yield bus


@pytest.fixture
def learner(tiny_model_dir: Path, bus: RedisBus, tmp_path: Path) -> Iterator[Learner]:  # noqa: F811
    """The learner's loop with real parts (engine, bus, control, reporting)."""
    with learner_loop(settings(tiny_model_dir, tmp_path, "learner.prompts_per_step=3"), bus) as learner:
        yield learner


class OutOfMemory:
    """The learner's trainer, with an update that raises what no group causes on its own (the probe of
    each group alone passes): out of memory, say."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def __getattr__(self, name: str) -> object:
        return getattr(self.trainer, name)

    def update(
        self, batch: Batch, step: int, cfg: LearnerSettings
    ) -> tuple[dict[str, float], dict[str, float]]:
        raise RuntimeError("out of memory (simulated)")


def counter(learner: Learner, name: str) -> float:
    return float(learner.reports.metrics.registry.get_sample_value(name) or 0.0)


def publish(bus: RedisBus, *groups: TrajectoryGroup) -> None:
    for g in groups:
        assert bus.publish_group(g.group_id, encode_group(g))


def test_bad_groups_are_dead_lettered_alone_and_training_goes_on(
    tiny_model_dir: Path,  # noqa: F811
    bus: RedisBus,
    tmp_path: Path,
) -> None:
    with learner_loop(settings(tiny_model_dir, tmp_path, "learner.prompts_per_step=4"), bus) as learner:
        good = [group(10 + i) for i in range(4)]
        publish(
            bus, good[0], group(20, vocab=1000), good[1], group(21, k=3), group(22, prompt_len=500), good[2]
        )
        batch = learner.collector.fill(0, learner.live.max_staleness, lambda: False)
        # The foreign-vocabulary and too-long groups are set aside; the narrower top-k trains with the rest.
        kept = [good[0], good[1], group(21, k=3), good[2]]
        assert [g.group_id for g in batch.groups] == [g.group_id for g in kept]
        reasons = {d.item_id: d.reason for d in bus.dead_letters()}
        assert "declares vocab_size 1000" in reasons[group(20, vocab=1000).group_id]
        assert "exceeds the model's context" in reasons[group(22, prompt_len=500).group_id]
        assert learner.step(batch) is not None and learner.state.step == 1


def test_a_step_that_raises_sends_its_groups_back_and_dead_letters_the_culprit(
    learner: Learner, bus: RedisBus
) -> None:
    good = [group(30 + i) for i in range(3)]
    publish(bus, *good)
    batch = learner.collector.fill(0, learner.live.max_staleness, lambda: False)
    # A group that slipped past the checks (ids beyond the embedding) makes the forward raise.
    poison = group(40, vocab=1000)
    batch.groups[1] = poison
    assert learner.step(batch) is None, "the step must fail, not the process"
    assert learner.state.step == 0 and counter(learner, "sparkrl_learner_step_failures_total") == 1
    [letter] = bus.dead_letters()
    assert letter.item_id == good[1].group_id and letter.reason.startswith("fails alone: IndexError")
    # The others are first in line for the next step, still pending (nothing acknowledged, nothing lost).
    assert [g.group_id for g in learner.collector.groups] == [good[0].group_id, good[2].group_id]
    assert bus.pending_info("trajectories").pending == 2
    publish(bus, group(50))
    retry = learner.collector.fill(0, learner.live.max_staleness, lambda: False)
    assert {g.group_id for g in retry.groups} == {good[0].group_id, good[2].group_id, group(50).group_id}
    assert learner.step(retry) is not None and learner.state.step == 1


def test_a_group_that_fails_two_steps_is_dead_lettered(
    tiny_model_dir: Path,  # noqa: F811
    bus: RedisBus,
    tmp_path: Path,
) -> None:
    publish(bus, *(group(60 + i) for i in range(3)))
    cfg = settings(tiny_model_dir, tmp_path, "learner.prompts_per_step=3")
    with learner_loop(cfg, bus, trainer_as=OutOfMemory) as learner:
        batch = learner.collector.fill(0, learner.live.max_staleness, lambda: False)
        # A failure no group causes on its own (the probe passes): every group goes back, twice at most.
        assert learner.step(batch) is None and bus.dead_letters() == []
        again = learner.collector.fill(0, learner.live.max_staleness, lambda: False)
        assert learner.step(again) is None
    assert {d.item_id for d in bus.dead_letters()} == {g.group_id for g in batch.groups}
    assert all("failed two training steps, last: RuntimeError" in d.reason for d in bus.dead_letters())


def test_sparkrl_dead_lists_and_requeues(bus_settings: BusSettings) -> None:
    bus = RedisBus(bus_settings)
    publish(bus, group(70))
    [entry] = bus.read("trajectories", "learner", 1)
    bus.dead_letter("trajectories", entry, "a reason for people")
    env_args = ["--set", f"bus.url={bus_settings.url}", "--set", f"bus.namespace={bus_settings.namespace}"]

    def sparkrl(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "sparkrl.cli", "dead", *args, *env_args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    listing = sparkrl()
    assert listing.returncode == 0, listing.stderr
    assert "1 dead letters" in listing.stdout and "a reason for people" in listing.stdout
    [letter] = bus.dead_letters()
    assert letter.record_id in listing.stdout and group(70).group_id in listing.stdout
    requeued = sparkrl("--requeue", letter.record_id)
    assert requeued.returncode == 0 and f"requeued {letter.record_id}" in requeued.stdout
    assert (
        bus.dead_letters() == [] and bus.read("trajectories", "learner", 1)[0].item_id == group(70).group_id
    )
    assert sparkrl("--requeue", letter.record_id).returncode == 1  # gone now
    nowhere = subprocess.run([sys.executable, "-m", "sparkrl.cli", "dead"], capture_output=True, text=True)
    assert nowhere.returncode != 0 and "say which Redis" in nowhere.stderr
    bus.close()
