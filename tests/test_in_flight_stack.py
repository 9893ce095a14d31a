"""In-flight weight updates on the real stack (private redis-server, the reward service, a torch-engine
worker or a vLLM one (its CPU build, .venv-vllm), the DeepSpeed learner, loopback only): versions land
while the worker is mid-generation, the published samples carry two versions, and the tokens after each
swap are what the new version's weights sample (its checkpoint's model, teacher-forced: the engine
contract's tolerance). Every group is trained exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _faults import assert_exactly_once, settings, steps_done, wait
from _stream_follower import StreamFollower
from _tiny import babbling_model_dir, tiny_model_dir  # noqa: F401  (fixtures)
from conftest import start_stack
from test_engine_contract import TOLERANCE
from test_vllm_up import vllm_settings
from transformers import PreTrainedModel

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.proto import Completion, TrajectoryGroup
from sparkrl.services.common.modeling import load_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 4


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


# Every version's weights differ: the babbling model's rewards are ~0, the entropy bonus reaches its A = 0
# tokens. A batch outlasts a learner step: its completions run to the cap (vLLM refuses min_new_tokens).
IN_FLIGHT = (
    "rollout.weight_updates=in_flight",
    "rollout.in_flight.kv_cache=recompute",  # exactly the new version's (keep: test_engine_in_flight.py)
    "rollout.in_flight.poll_s=0.01",
    "rollout.sampling.max_new_tokens=96",
    "learner.loss.name=entropy_bonus",
    "learner.loss.entropy_coef=0.5",
    "learner.lr=1.0e-3",
    "learner.checkpoint_every=1",  # every version's weights kept, to check its tokens against
    "learner.keep_checkpoints=100",
)


# How far a token's recorded log-prob may be from its version's, teacher-forced. The babbling model's
# logits are 3x the tiny model's, and so are their rounding differences; a swapped-in worker's batch adds
# its own (measured on the torch engine: 2e-5 to 1.3e-4 per sample, once 3.7e-4 on one token of 53 on a
# busy machine). A token tagged with the wrong version is off by 2.6 to 9 (the `apart` check), so 10x the
# engine contract's tolerance still tells every version apart by over a hundredfold.
SWAP_ATOL = {engine: 10 * tolerance for engine, tolerance in TOLERANCE.items()}


@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_versions_land_mid_generation_and_later_tokens_are_the_new_weights(
    engine: str,
    babbling_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """A torch-engine worker, or a vLLM one (its CPU build; in-process engine core, stepped by hand)."""
    run_dir = tmp_path / "run"
    if engine == "torch":
        cfg = settings(babbling_model_dir, run_dir, *IN_FLIGHT, f"learner.max_steps={STEPS}")
    else:
        cfg = vllm_settings(babbling_model_dir, run_dir, STEPS, *IN_FLIGHT)
    plan = plan_stack(cfg, workers=1, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=240))
    # What the learner trained before the follower started is not seen: the first step's, all version 0.
    follower = StreamFollower(plan.settings.bus)
    follower.start()
    learner = stack.procs["learner"]
    wait("the learner's last step", lambda: learner.poll() is not None, plan.run_dir, timeout_s=500)
    groups = follower.stop()
    assert learner.returncode == 0, (plan.run_dir / "logs" / "learner.log").read_text()[-3000:]
    assert steps_done(plan.run_dir) == STEPS
    assert_exactly_once(plan, STEPS, queued_ok=True)  # the worker keeps making groups to the end
    assert_the_swaps_are_the_new_weights(groups, plan.run_dir, babbling_model_dir, SWAP_ATOL[engine])
    assert_the_rows_report_mixed_versions(plan.run_dir)


def assert_the_swaps_are_the_new_weights(
    groups: list[TrajectoryGroup], run_dir: Path, model_dir: Path, atol: float
) -> None:
    """Some published samples hold two versions, and each version's tokens are what its weights sample
    (teacher-forced, within `atol`); the versions differ enough that a token tagged with the wrong one
    would show."""
    mixed = [(g, c) for g in groups for c in g.completions if len(set(c.policy_versions.tolist())) == 2]
    assert mixed, f"no sample of {len(groups)} groups holds two versions"
    models: dict[int, PreTrainedModel] = {}

    def model(version: int) -> PreTrainedModel:
        if version not in models:
            models[version] = model_at(run_dir, model_dir, version)
        return models[version]

    apart = []  # per sample: how far the older version's log-probs are from the newer tokens' recorded ones
    for group, c in mixed[:6]:
        versions = c.policy_versions
        assert (np.diff(versions) >= 0).all()
        for version in sorted(set(versions.tolist())):
            at = versions == version
            np.testing.assert_allclose(
                c.logprobs[at], forced_logprobs(model(version), group, c)[at], atol=atol
            )
        older, newer = versions.min(), versions == versions.max()
        apart.append(float(np.abs(forced_logprobs(model(older), group, c)[newer] - c.logprobs[newer]).max()))
    assert max(apart) > 10 * atol, f"the versions' weights barely differ ({apart}): the check shows nothing"


def assert_the_rows_report_mixed_versions(run_dir: Path) -> None:
    rows = [json.loads(line)["metrics"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any((r.get("rollout/mixed_version_share") or 0) > 0 for r in rows)
    assert all(0 <= r["rollout/token_lag_0_share"] <= 1 for r in rows)
