"""Every model family our users train, on both engines: a short real run of each (`sparkrl up`'s stack).

Each family is a tiny random model built from transformers' own classes with its chat template
(`_families.py`). A run trains it for a few steps with a loss whose gradient is not zero on a random
model (GRPO + a large entropy bonus: the countdown rewards of a random model are all 0, so advantages are
too), and shows:

- every published group trained once, and the weights moved (the final version is not the start);
- every worker on the learner's last version (its checksum: what the learner sent);
- the worker's log-probs of what it sampled after an update agree with the learner's model of that
  version (the engine contract's tolerance), read off the trajectory stream as the run goes;
- the final checkpoint's export loading with `from_pretrained`, holding that last version.

`make test` runs the cases `FAST` names (the slow tier); the rest carry the `families` mark and run in
`make test-families`, which `.ci/run` runs too (docs/models.md: the table, and how to add a family).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from _families import FAMILIES, build_family
from _faults import assert_exactly_once, wait
from _stream_follower import StreamFollower
from conftest import start_stack
from test_engine_contract import TOLERANCE
from test_vllm_setup import vllm_python
from transformers import AutoModelForCausalLM

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.plan import StackPlan
from sparkrl.proto import TrajectoryGroup, WeightAnnouncement, WorkerStatus
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import SparkSettings, load_settings
from sparkrl.services.common.weight_sync import distinct_tensors, weights_checksum

pytestmark = pytest.mark.slow

STEPS = 3
ENGINES = ("torch", "vllm")
# In `make test`: the family that broke (Gemma 2 on vLLM), a tied family on the torch engine, LoRA on a
# tied family. Everything else: `make test-families`.
FAST = {("gemma2", "vllm"), ("qwen3", "torch"), ("llama", "vllm")}
# What an engine cannot train, refused before anything starts (docs/models.md: known not to work).
REFUSED = {("qwen3_moe", "vllm"): "a mixture of experts (4 experts): vLLM's CPU build does not re-pack"}
CASES = [
    pytest.param(
        key, engine, id=f"{key}-{engine}", marks=() if (key, engine) in FAST else pytest.mark.families
    )
    for key in FAMILIES
    for engine in ENGINES
    if (key, engine) not in REFUSED
]


def family_settings(model_dir: Path, run_dir: Path, engine: str, *extra: str) -> SparkSettings:
    """A short run of `model_dir` on `engine`; `extra` overrides come last."""
    on_vllm = (
        [f"rollout.python={vllm_python()}", "rollout.engine.max_model_len=512"] if engine == "vllm" else []
    )
    return load_settings(
        "vllm-cpu" if engine == "vllm" else "smoke",
        [
            f"model={model_dir}",
            f"run_dir={run_dir}",
            *on_vllm,
            "rollout.prompts_per_batch=2",
            "rollout.sampling.n=4",
            "rollout.sampling.max_new_tokens=12",
            "rollout.sampling.topk_logprobs=8",
            "learner.loss.name=entropy_bonus",
            "learner.loss.entropy_coef=0.5",  # the whole gradient, on a random model's zero rewards
            "learner.lr=3e-3",
            "learner.old_logp_source=recompute",
            "learner.skip_zero_advantage=false",
            f"learner.max_steps={STEPS}",
            "learner.prompts_per_step=2",
            "learner.checkpoint_every=1",
            f"learner.keep_checkpoints={STEPS + 1}",  # every version's model, for the log-prob check
            "learner.max_staleness=1000",  # nothing dropped as stale: every published group is trained
            f"prompts.count={STEPS * 8}",
            "bus.trajectory_maxlen=8",
            *extra,
        ],
    )


def run_family(
    key: str, engine: str, tmp_path: Path, stacks: list[Stack], *extra: str
) -> tuple[StackPlan, list]:
    """Build the family, run it to the end; the plan and the groups the workers published."""
    model_dir = build_family(key, tmp_path.parent / "families")
    plan = plan_stack(
        family_settings(model_dir, tmp_path / "run", engine, *extra), workers=1, private_redis=True
    )
    write_configs(plan)
    follower = StreamFollower(plan.settings.bus)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=240))
    follower.start()
    learner = stack.procs["learner"]
    wait("the learner to finish", lambda: learner.poll() is not None, plan.run_dir, timeout_s=480)
    assert learner.returncode == 0, (plan.run_dir / "logs" / "learner.log").read_text()[-3000:]
    assert_exactly_once(plan, STEPS, queued_ok=True)
    return plan, follower.stop()


def assert_worker_on_the_last_version(plan: StackPlan) -> str:
    """The worker reports the learner's last announcement; its checksum."""
    bus = RedisBus(plan.settings.bus)
    announcement = WeightAnnouncement.model_validate_json(bus.get_value("weights") or b"")
    assert announcement.version == STEPS

    def synced() -> bool:
        raw = bus.statuses("worker").get("worker-0")
        return (
            raw is not None
            and WorkerStatus.model_validate_json(raw).weights_checksum == announcement.checksum
        )

    wait("the worker to hold the last version", synced, plan.run_dir, timeout_s=240)
    bus.close()
    return announcement.checksum


@torch.no_grad()
def assert_logprobs_agree(plan: StackPlan, groups: list[TrajectoryGroup], atol: float) -> tuple[int, float]:
    """Each completion sampled by an updated version (≥ 1, one version throughout) against log_softmax of
    that version's checkpoint (the learner's model) over prompt + completion: how many were checked, and
    the largest difference."""
    checked, largest, models = 0, 0.0, {}
    for group in groups:
        prompt = group.prompt_token_ids.tolist()
        for completion in group.completions:
            versions = set(completion.policy_versions.tolist())
            if len(versions) != 1 or min(versions) < 1 or not len(completion.token_ids):
                continue
            [version] = versions
            if version not in models:
                hf = plan.run_dir / "checkpoints" / f"step-{version:06d}" / "hf"
                models[version] = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
            ids = torch.tensor([prompt + completion.token_ids.tolist()])
            logits = models[version](input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits / group.sampling.temperature, dim=-1)
            sampled = logp.gather(1, torch.tensor(completion.token_ids.tolist())[:, None]).squeeze(1)
            np.testing.assert_allclose(completion.logprobs, sampled.numpy(), atol=atol)
            checked += 1
            largest = max(largest, float(np.abs(completion.logprobs - sampled.numpy()).max()))
    assert checked, "no completion was sampled after an update"
    return checked, largest


@pytest.mark.parametrize(("key", "engine"), CASES)
def test_a_family_trains_on_an_engine(
    key: str, engine: str, tmp_path: Path, stacks: list[Stack], record_property: Callable[[str, object], None]
) -> None:
    plan, groups = run_family(key, engine, tmp_path, stacks)
    checksum = assert_worker_on_the_last_version(plan)
    export = plan.run_dir / "checkpoints" / f"step-{STEPS:06d}" / "hf"
    final = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert weights_checksum(distinct_tensors(final.state_dict()).items()) == checksum
    start = AutoModelForCausalLM.from_pretrained(build_family(key, tmp_path.parent / "families"))
    assert weights_checksum(distinct_tensors(start.state_dict()).items()) != checksum, (
        "the weights never moved"
    )
    assert FAMILIES[key].tied == (final.lm_head.weight is final.get_input_embeddings().weight)
    checked, largest = assert_logprobs_agree(plan, groups, TOLERANCE[engine])
    record_property("completions_checked", checked)  # for the table in docs/models.md (families_table.py)
    record_property("max_logprob_diff", f"{largest:.1e}")
    worker_log = (plan.run_dir / "logs" / "worker-0.log").read_text()
    assert f"engine {engine}" in worker_log


@pytest.mark.parametrize(
    "engine", [pytest.param("torch"), pytest.param("vllm", marks=pytest.mark.families)], ids=ENGINES
)
def test_lora_on_a_tied_family(engine: str, tmp_path: Path, stacks: list[Stack]) -> None:
    """Qwen3 (tied) with LoRA, the adapter alone sent (merged by the worker into its base): the worker
    ends on the last adapter, and the export (the merged model) loads."""
    lora = ["learner.lora.r=8", "learner.lora.alpha=16"]
    plan, groups = run_family("qwen3", engine, tmp_path, stacks, *lora)
    assert_worker_on_the_last_version(plan)
    merged = AutoModelForCausalLM.from_pretrained(plan.run_dir / "checkpoints" / f"step-{STEPS:06d}" / "hf")
    assert merged.lm_head.weight is merged.get_input_embeddings().weight
    assert_logprobs_agree(plan, groups, TOLERANCE[engine])


@pytest.mark.parametrize(("key", "engine"), [pytest.param(*case, id="-".join(case)) for case in REFUSED])
def test_a_family_an_engine_cannot_train_is_refused_before_start(
    key: str, engine: str, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """`sparkrl up` exits 2 naming the reason and the fix, before anything is spawned."""
    model_dir = build_family(key, tmp_path.parent / "families")
    python = ["--set", f"rollout.python={vllm_python()}"] if engine == "vllm" else []
    preset = "vllm-cpu" if engine == "vllm" else "smoke"
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "sparkrl.cli", "up", "--preset", preset, "--run-dir", str(run_dir),
         "--model", str(model_dir), *python],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert REFUSED[key, engine] in done.stderr and "Traceback" not in done.stderr
    assert not (run_dir / "config").exists()  # nothing was written for a service, nothing spawned
    record_property("refused", REFUSED[key, engine])


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
def test_qwen3s_enable_thinking_reaches_what_the_model_saw(
    thinking: bool, tmp_path: Path, stacks: list[Stack]
) -> None:
    """`rollout.chat_template_kwargs` reaches Qwen3's template in the workers: with enable_thinking false
    every prompt the model saw (samples.jsonl's rendered_prompt) ends in the empty think block Qwen3's
    template writes, and with it true in the bare assistant turn; the raw question is kept beside it."""
    kwargs = f"rollout.chat_template_kwargs={{enable_thinking: {str(thinking).lower()}}}"
    plan, _ = run_family("qwen3", "torch", tmp_path, stacks, kwargs, "learner.samples_per_step=2")
    rows = [json.loads(line) for line in (plan.run_dir / "samples.jsonl").read_text().splitlines()]
    assert rows
    ending = "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
    for row in rows:
        assert row["rendered_prompt"].endswith(ending), row["rendered_prompt"][-60:]
        assert row["rendered_prompt"].startswith("<|im_start|>user\n" + row["prompt"])
    worker_log = (plan.run_dir / "logs" / "worker-0.log").read_text()
    said = f'kwargs {{"enable_thinking": {str(thinking).lower()}}}'
    assert said in worker_log  # said at start: the rendering in force
