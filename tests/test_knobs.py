"""The knobs TRL and verl users reach for, each against hand-computed values: the lr schedule, the KL
estimators to a reference, the advantage modes, mini-batch splitting, and one real run with all of them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env
from torch.testing import assert_close

from sparkrl.proto.testing import random_group
from sparkrl.services.common.settings import BusSettings, LearnerSettings, PromptFormat, ScheduleSettings
from sparkrl.services.learner.advantages import step_advantages
from sparkrl.services.learner.reference import kl_to_reference
from sparkrl.services.learner.schedule import lr_factor
from sparkrl.services.learner.update import split_groups

ROOT = Path(__file__).resolve().parents[1]


def test_lr_schedule_by_hand() -> None:
    cosine = ScheduleSettings(kind="cosine", warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_factor(s, cosine, 12) for s in (1, 2, 4)] == [0.25, 0.5, 1.0]  # warm-up
    # step 5: p = (5 − 4) / (12 − 4) = 1/8 → 0.1 + 0.9 · ½(1 + cos(π/8))
    assert lr_factor(5, cosine, 12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 8)))
    assert lr_factor(12, cosine, 12) == pytest.approx(0.1) and lr_factor(20, cosine, 12) == pytest.approx(0.1)
    linear = ScheduleSettings(kind="linear", warmup_steps=4, min_lr_ratio=0.1)
    assert lr_factor(8, linear, 12) == pytest.approx(0.55)  # p = 1/2
    assert lr_factor(1, ScheduleSettings(), None) == 1.0 == lr_factor(1000, ScheduleSettings(), None)
    with pytest.raises(ValueError, match=r"decays to learner\.max_steps"):
        LearnerSettings(schedule={"kind": "cosine"})
    with pytest.raises(ValueError):
        lr_factor(0, cosine, 12)


def test_kl_estimators_by_hand() -> None:
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.25)]])
    d = math.log(2.0)  # log π − log π_ref at the first token; 0 at the second
    assert_close(kl_to_reference(logp, ref, "k1"), torch.tensor([[d, 0.0]]))
    assert_close(kl_to_reference(logp, ref, "k2"), torch.tensor([[0.5 * d * d, 0.0]]))
    k3 = kl_to_reference(logp, ref, "k3")
    assert_close(k3, torch.tensor([[0.5 + d - 1.0, 0.0]]))  # π_ref/π = ½
    k3.sum().backward()  # d k3 / d logp = 1 − π_ref/π
    assert_close(logp.grad, torch.tensor([[0.5, 0.0]]))
    far = kl_to_reference(torch.tensor([[-30.0]]), torch.tensor([[0.0]]), "k3")
    assert far.item() == 10.0  # clamped: one token far off the reference cannot swamp a step
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_to_reference(logp, ref, "k4")


def test_advantage_modes_by_hand() -> None:
    rewards = [torch.tensor([1.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1.0])]
    group = step_advantages(rewards)  # GRPO: std of [1, 0, 0] (unbiased) = 1/√3
    assert_close(group[0], torch.tensor([2 / 3, -1 / 3, -1 / 3]) * math.sqrt(3), atol=1e-5, rtol=0)
    assert_close(group[1], torch.zeros(3)) and assert_close(group[2], torch.zeros(1))
    dr = step_advantages(rewards, std_normalize=False)  # Dr. GRPO: reward − group mean
    assert_close(dr[0], torch.tensor([2 / 3, -1 / 3, -1 / 3]))
    batch = step_advantages(rewards, level="batch")  # the std of all seven rewards (five 1s, two 0s)
    every = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    assert_close(batch[0], torch.tensor([2 / 3, -1 / 3, -1 / 3]) / (every.std() + 1e-6))
    assert_close(batch[1], torch.zeros(3)) and assert_close(batch[2], torch.zeros(1))


def test_groups_split_into_contiguous_mini_batches() -> None:
    rng = __import__("numpy").random.default_rng(0)
    groups = [random_group(rng, n=2, T=3, k=2, vocab_size=50) for _ in range(5)]
    parts = split_groups(groups, 2)
    assert [len(p) for p in parts] == [2, 3] and [g for p in parts for g in p] == groups
    assert [len(p) for p in split_groups(groups, 8)] == [1] * 5  # never more parts than groups
    assert split_groups(groups, 1) == [groups]


@pytest.mark.slow
def test_a_run_with_kl_two_updates_per_rollout_and_a_cosine_schedule(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    run_dir, lr = tmp_path / "run", 1e-4
    overrides = [
        f"model={tiny_model_dir}", "learner.max_steps=4", f"learner.lr={lr}", "learner.kl.coef=0.1",
        "learner.updates_per_rollout=2", "learner.schedule.kind=cosine", "learner.schedule.warmup_steps=1",
        "learner.advantage.drop_equal_groups=true",
    ]  # fmt: skip
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--preset", "smoke", "--run-dir", str(run_dir)]
    env = clean_env()
    done = subprocess.run(
        [*command, *(a for o in overrides for a in ("--set", o))],
        capture_output=True, text=True, timeout=400, cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    schedule = ScheduleSettings(kind="cosine", warmup_steps=1)
    for row in rows:
        m = row["metrics"]
        assert row["hparams"]["lr"] == pytest.approx(lr * lr_factor(row["step"], schedule, 4))
        kept = m["rollout/groups"] - m["loss/equal_groups_dropped"]
        assert m["loss/updates"] == min(2, kept)  # one optimizer step per mini-batch
        if kept:
            assert m["loss/kl_ref"] is not None and m["loss/kl_ref"] >= 0  # k3 ≥ 0
    assert rows[0]["hparams"]["lr"] == pytest.approx(lr)  # warm-up of one step: the full rate at step 1


def test_overlong_prompts_are_dropped_with_a_reason_or_truncated(
    tiny_model_dir: Path,  # noqa: F811
    bus_settings: BusSettings,
) -> None:
    from sparkrl.proto import Prompt, encode_message
    from sparkrl.services.common.bus import RedisBus
    from sparkrl.services.common.prompt_limits import PromptLimits
    from sparkrl.services.common.settings import TorchEngineSettings
    from sparkrl.services.rollout.torch_engine import TorchEngine
    from sparkrl.services.rollout.worker import pull_prompts

    engine = TorchEngine(tiny_model_dir, TorchEngineSettings(threads=1))
    texts = {"short-1": "Use 1 2 to make 3.\n", "long": "Use 1 2 3 " * 10 + "to make 6.\n", "short-2": "hi"}
    with RedisBus(bus_settings) as bus:
        for mode in ("drop", "truncate"):
            for pid, text in texts.items():
                bus.publish_prompt(
                    f"{mode}-{pid}",
                    encode_message(Prompt(prompt_id=f"{mode}-{pid}", task="countdown", text=text)),
                )
            batch = pull_prompts(bus, engine, "w", 10, PromptLimits(24, overlong=mode), fmt=PromptFormat())
            assert batch is not None and all(len(ids) <= 24 for ids in batch.token_ids)
            bus.ack("prompts", [e.entry_id for e in batch.entries])
            if mode == "drop":
                assert [p.prompt_id for p in batch.prompts] == ["drop-short-1", "drop-short-2"]
                (dead,) = bus.dead_letters(10)
                assert "over rollout.max_prompt_tokens (24)" in dead.reason and dead.stream.endswith(
                    "prompts"
                )
            else:
                assert [p.prompt_id for p in batch.prompts] == [f"truncate-{p}" for p in texts]
                full = engine.tokenizer(texts["long"])["input_ids"]
                assert batch.token_ids[1] == full[-24:]  # the question's end is kept
    engine.close()


def test_aggregation_weights_by_hand() -> None:
    from sparkrl.services.learner.aggregation import aggregation_weights

    # Two completions: A has 3 tokens, B has 1. N = 4 tokens, S = 2 sequences.
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    loss = torch.tensor([[1.0, 2.0, 3.0, 99.0], [8.0, 99.0, 99.0, 99.0]])  # 99 on padding: never counted

    def mean_of(weights: torch.Tensor | None) -> float:
        w = torch.ones_like(loss) if weights is None else weights
        return float((w * loss * mask).sum() / mask.sum())

    assert mean_of(aggregation_weights(mask, "token_mean", 4, 2)) == pytest.approx((1 + 2 + 3 + 8) / 4)
    assert mean_of(aggregation_weights(mask, "seq_mean_token_sum", 4, 2)) == pytest.approx((6 + 8) / 2)
    assert mean_of(aggregation_weights(mask, "seq_mean_token_mean", 4, 2)) == pytest.approx((2 + 8) / 2)
    assert mean_of(aggregation_weights(mask, "dr_grpo", 4, 2, norm_length=8)) == pytest.approx(14 / 16)
    # Split over two micro-batches, each token-mean weighted by its token share, as the trainer does:
    # the global totals make it the same number.
    parts = [(mask[:1], loss[:1]), (mask[1:], loss[1:])]
    split = sum(
        float((aggregation_weights(m, "seq_mean_token_mean", 4, 2) * part * m).sum() / m.sum())
        * int(m.sum())
        / 4
        for m, part in parts
    )
    assert split == pytest.approx(5.0)
    with pytest.raises(ValueError, match="constant length"):
        aggregation_weights(mask, "dr_grpo", 4, 2)
    with pytest.raises(ValueError, match="aggregates by its own definition"):
        LearnerSettings(loss={"name": "gspo"}, loss_aggregation="seq_mean_token_mean")


def test_an_update_aggregates_as_configured(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    from _learner import one_rank, settings

    from sparkrl.services.learner.batch import micro_batches, samples_from_groups
    from sparkrl.services.learner.ledger import Batch

    rng = __import__("numpy").random.default_rng(3)
    groups = [random_group(rng, n=4, T=6, k=4, vocab_size=259) for _ in range(3)]
    for mode in ("token_mean", "seq_mean_token_mean"):
        # π_old recomputed by the learner and no IS weights: the ratio is 1, so loss_t = −A_t exactly.
        overrides = ["learner.old_logp_source=recompute", "learner.tis_cap=null", "learner.loss.name=grpo"]
        overrides += ["learner.micro_batch_tokens=64", f"learner.loss_aggregation={mode}"]
        trainer = one_rank(settings(tiny_model_dir, tmp_path, *overrides))
        batches = micro_batches(samples_from_groups(groups), token_budget=64, pad_id=0)  # as it cuts them
        assert len(batches) > 1  # the global totals matter
        stats = trainer.update(Batch(groups, []), 1, trainer.cfg).row()
        rows = [
            (-mb.advantages[i][mb.mask[i]]) for mb in batches for i in range(len(mb.mask)) if mb.mask[i].any()
        ]
        expected = (
            float(torch.cat(rows).mean())
            if mode == "token_mean"
            else float(torch.stack([r.mean() for r in rows]).mean())
        )
        assert stats["loss"] == pytest.approx(expected, abs=1e-5)
