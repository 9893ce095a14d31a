"""In-flight weight updates on the real stack (private redis-server, the reward service, a torch-engine
worker, the DeepSpeed learner, loopback only): versions land while the worker is mid-generation, the
published samples carry two versions, and the tokens after each swap are what the new version's weights
sample (its checkpoint's model, teacher-forced: the engine contract's tolerance). Every group is trained
exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _faults import assert_exactly_once, settings, steps_done, wait
from _stream_follower import StreamFollower
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import start_stack
from transformers import PreTrainedModel

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.proto import Completion, TrajectoryGroup
from sparkrl.services.common.modeling import load_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 4
ATOL = 1e-4  # the torch engine's contract tolerance (tests/test_engine_contract.py)


def model_at(run_dir: Path, tiny: Path, version: int) -> PreTrainedModel:
    """The weights of policy `version`: the checkpoint of the step that made it (version 0: the model)."""
    path = tiny if version == 0 else run_dir / "checkpoints" / f"step-{version:06d}" / "hf"
    return load_model(path, "float32", "cpu")


@torch.no_grad()
def forced_logprobs(model: PreTrainedModel, group: TrajectoryGroup, c: Completion) -> np.ndarray:
    """log_softmax(logits / T) of each generated token, the prompt and completion in one pass."""
    prompt = group.prompt_token_ids.tolist()
    ids = torch.tensor([prompt + c.token_ids.tolist()])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / group.sampling.temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.from_numpy(c.token_ids.astype(np.int64))[:, None]).squeeze(1).numpy()


def test_versions_land_mid_generation_and_later_tokens_are_the_new_weights(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    cfg = settings(
        tiny_model_dir,
        tmp_path / "run",
        "rollout.weight_updates=in_flight",
        "rollout.in_flight.kv_cache=recompute",  # exactly the new version's (keep: test_engine_in_flight.py)
        "rollout.in_flight.poll_s=0.01",
        "rollout.sampling.max_new_tokens=96",  # a batch outlasts a learner step
        "rollout.sampling.min_new_tokens=96",
        f"learner.max_steps={STEPS}",
        "learner.checkpoint_every=1",  # every version's weights kept, to check its tokens against
        "learner.keep_checkpoints=100",
    )
    plan = plan_stack(cfg, workers=1, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    # What the learner trained before the follower started is not seen: the first step's, all version 0.
    follower = StreamFollower(plan.settings.bus)
    follower.start()
    learner = stack.procs["learner"]
    wait("the learner's last step", lambda: learner.poll() is not None, plan.run_dir, timeout_s=400)
    groups = follower.stop()
    assert learner.returncode == 0, (plan.run_dir / "logs" / "learner.log").read_text()[-3000:]
    assert steps_done(plan.run_dir) == STEPS
    assert_exactly_once(plan, STEPS, queued_ok=True)  # the worker keeps making groups to the end

    mixed = [(g, c) for g in groups for c in g.completions if len(set(c.policy_versions.tolist())) == 2]
    assert mixed, f"no sample of {len(groups)} groups holds two versions"
    models: dict[int, PreTrainedModel] = {}
    for group, c in mixed[:6]:
        versions = c.policy_versions
        assert (np.diff(versions) >= 0).all()
        for version in sorted(set(versions.tolist())):
            if version not in models:
                models[version] = model_at(plan.run_dir, tiny_model_dir, version)
            at = versions == version
            expected = forced_logprobs(models[version], group, c)
            np.testing.assert_allclose(c.logprobs[at], expected[at], atol=ATOL)
    rows = [json.loads(line)["metrics"] for line in (plan.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any((r.get("rollout/mixed_version_share") or 0) > 0 for r in rows)
    assert all(0 <= r["rollout/token_lag_0_share"] <= 1 for r in rows)
