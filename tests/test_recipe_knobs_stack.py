"""The recipe knobs on the real stack (private redis-server, a worker, the reward service, the DeepSpeed
learner, loopback only), one short run each until its data runs out: every published group is trained
exactly once or filtered exactly once, and the knob's telemetry is in the step rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from _faults import assert_exactly_once, settings, steps_done, wait
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import start_stack

from sparkrl.launcher import Stack, plan_stack, write_configs

pytestmark = pytest.mark.slow

PER_STEP, PROMPTS = 4, 20


def run_to_the_end(model_dir: Path, run_dir: Path, stacks: list[Stack], *knob: str) -> list[dict]:
    """The smoke preset with `knob` on, until the data runs out; the exactly-once invariant; the rows."""
    cfg = settings(
        model_dir,
        run_dir,
        f"learner.prompts_per_step={PER_STEP}",
        f"prompts.count={PROMPTS}",
        "learner.max_steps=100",  # the data ends the run
        "learner.checkpoint_every=100",
        *knob,
    )
    plan = plan_stack(cfg, workers=1, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    learner = stack.procs["learner"]
    wait("the data to run out", lambda: learner.poll() is not None, plan.run_dir, timeout_s=400)
    assert learner.returncode == 0, (plan.run_dir / "logs" / "learner.log").read_text()[-3000:]
    steps = steps_done(plan.run_dir)
    assert_exactly_once(plan, steps)
    return [json.loads(line) for line in (plan.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_dynamic_sampling_fills_steps_and_records_the_filtered(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    run_dir = tmp_path / "run"
    rows = run_to_the_end(tiny_model_dir, run_dir, stacks, "learner.filter_groups=zero_variance")
    trail = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    aside = [json.loads(line) for line in (run_dir / "filtered_groups.jsonl").read_text().splitlines()]
    filtered = [gid for record in aside for gid in record["group_ids"]]
    trained = [gid for record in trail for gid in record["group_ids"]]
    assert filtered, "the untrained tiny model answers most countdown groups alike: some are filtered"
    assert len(trained) + len(filtered) == PROMPTS
    # Every step but the data's last is a full batch of informative groups.
    assert all(r["metrics"]["rollout/groups"] == PER_STEP for r in rows[:-1])
    metrics = [r["metrics"] for r in rows]
    # The rows count those set aside while each batch was gathered (after the last batch: only the file).
    counted = [m.get("rollout/groups_filtered") or 0 for m in metrics]
    assert 0 < sum(counted) <= len(filtered)
    assert max(m.get("rollout/groups_filtered_total") or 0 for m in metrics) == sum(counted)
    assert all(0 <= (m.get("rollout/filtered_share") or 0) < 1 for m in metrics)
    assert all(m["rollout/groups_uninformative"] == 0 for m in metrics)  # none of them reaches a batch
    ended = json.loads((run_dir / "ended.json").read_text())
    assert ended["prompts"]["filtered"] == len(filtered) and ended["prompts"]["dropped"] == 0


def test_overlong_shaping_and_masking(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    run_dir = tmp_path / "run"
    knob = ("rollout.overlong_buffer.len=8", "learner.mask_truncated_completions=true")
    rows = run_to_the_end(tiny_model_dir, run_dir, stacks, *knob)
    metrics = [r["metrics"] for r in rows]
    assert all(-1.0 <= m["rollout/overlong_penalty_mean"] <= 0.0 for m in metrics)
    assert all(
        m["loss/truncated_masked"] is not None and 0 <= m["rollout/truncated_share"] <= 1 for m in metrics
    )
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    for sample in samples:  # max_new_tokens 16, len 8: free up to 8 tokens, then (8 − |y|) / 8
        expected = min(0.0, (8 - sample["tokens"]) / 8)
        assert sample["overlong_penalty"] == pytest.approx(expected)
        assert sample["reward"] == pytest.approx(sample["score"] + expected)
    worker = yaml.safe_load((run_dir / "config" / "worker-0.yaml").read_text())
    assert worker["rollout"]["overlong_buffer"] == {"len": 8, "penalty_factor": 1.0}  # in the run's config


def test_masked_importance_sampling(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    knob = ("learner.old_logp_source=recompute", "learner.is_mask=token", "learner.tis_level=sequence")
    rows = run_to_the_end(tiny_model_dir, tmp_path / "run", stacks, *knob)
    measured = [r["metrics"] for r in rows if r["metrics"].get("loss/is_seqs")]  # not a step all A = 0
    assert measured
    for m in measured:
        assert 0 <= m["loss/is_masked_share"] <= 1 and 0 <= m["loss/is_capped_share"] <= 1
        assert m["loss/mismatch_k3"] >= 0 and math.isfinite(m["loss/mismatch_kl"])


def test_an_fp32_lm_head_under_bf16_autocast(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    run_dir = tmp_path / "run"
    knob = ("learner.fp32_lm_head=true", "learner.autocast=bfloat16", "learner.old_logp_source=recompute")
    rows = run_to_the_end(tiny_model_dir, run_dir, stacks, *knob)
    assert (
        "learner.fp32_lm_head: the output projection's matmul runs in float32"
        in (run_dir / "logs" / "learner.log").read_text()
    )
    kls = [r["metrics"]["loss/mismatch_kl"] for r in rows if r["metrics"].get("loss/is_seqs")]
    assert kls and all(math.isfinite(kl) for kl in kls)  # the learner's log-probs against the worker's
