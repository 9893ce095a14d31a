"""Over-long reward shaping (DAPO's soft over-long punishment, services/rollout/shaping.py, in the worker's
scoring) and the learner's masking of truncated completions, against hand-computed values: the penalty's
ramp, the rewards a real reward service's scores become, the wire field, the masked update."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _tiny import tiny_model_dir  # noqa: F401  (fixture)

from sparkrl.proto import Prompt, decode_group, encode_group
from sparkrl.proto.errors import FieldError
from sparkrl.proto.testing import random_completion, random_group
from sparkrl.services.common.settings import RolloutSettings
from sparkrl.services.common.settings.rollout import OverlongBufferSettings
from sparkrl.services.rollout.shaping import overlong_penalty


def test_the_penalty_ramps_over_the_buffer_by_hand() -> None:
    # L_max = 24, L_cache = 8: free up to 16 tokens, then (16 − |y|) / 8, −1 at 24.
    buffer = OverlongBufferSettings(len=8)
    assert [overlong_penalty(t, 24, buffer) for t in (1, 16, 17, 20, 23, 24)] == [
        0.0, 0.0, -1 / 8, -0.5, -7 / 8, -1.0,
    ]  # fmt: skip
    assert overlong_penalty(25, 24, buffer) == -1.0  # past the budget (never sampled here): the ramp's end
    half = OverlongBufferSettings(len=8, penalty_factor=0.5)
    assert overlong_penalty(20, 24, half) == -0.25 and overlong_penalty(24, 24, half) == -0.5
    assert overlong_penalty(24, 24, OverlongBufferSettings()) == 0.0  # off by default
    with pytest.raises(ValueError, match=r"overlong_buffer\.len 24 must be below .*max_new_tokens \(24\)"):
        RolloutSettings(overlong_buffer={"len": 24}, sampling={"max_new_tokens": 24})


def test_the_wire_field_checks_and_round_trips() -> None:
    rng = np.random.default_rng(0)
    group = random_group(rng, n=3, T=4, k=2, vocab_size=50)
    shaped = group.model_copy(update={"overlong_penalties": [0.0, -0.25, -1.0]})
    assert decode_group(encode_group(shaped)).overlong_penalties == [0.0, -0.25, -1.0]
    assert decode_group(encode_group(group)).overlong_penalties is None  # unshaped, as before
    with pytest.raises((FieldError, ValueError), match="overlong_penalties"):
        type(group).model_validate(group.model_dump() | {"overlong_penalties": [0.0, -1.0]})
    with pytest.raises((FieldError, ValueError), match="a penalty is ≤ 0"):
        type(group).model_validate(group.model_dump() | {"overlong_penalties": [0.0, 0.5, 0.0]})


def test_the_workers_scoring_adds_the_penalty_to_the_services_score(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A real reward service scores three countdown completions (random text: 0 each); the worker adds
    the penalty of their lengths 10, 20, 24 under a budget of 24 and a buffer of 8: 0, −0.5, −1."""
    from _reward import reward_service

    from sparkrl.services.common.reward_client import RewardClient
    from sparkrl.services.common.settings import TorchEngineSettings
    from sparkrl.services.rollout.batch import PromptBatch, score_groups
    from sparkrl.services.rollout.torch_engine import TorchEngine

    cfg = RolloutSettings(overlong_buffer={"len": 8}, sampling={"max_new_tokens": 24, "topk_logprobs": 2})
    prompt = Prompt(
        prompt_id="p@0",
        task="countdown",
        text="Use 3 4 to make 7.",
        task_data={"numbers": [3, 4], "target": 7},
    )
    rng = np.random.default_rng(1)
    completions = [random_completion(rng, T, 2, 260, 0, 24) for T in (10, 20, 24)]
    engine = TorchEngine(tiny_model_dir, TorchEngineSettings(threads=1))
    with reward_service(tmp_path) as http:
        client = RewardClient(str(http.base_url))
        (group,) = score_groups(client, engine, PromptBatch([], [prompt], [[5, 6]]), [completions], cfg, "w")
        client.close()
    engine.close()
    assert [d.score for d in group.reward_details] == [0.0, 0.0, 0.0]
    assert group.overlong_penalties == [0.0, -0.5, -1.0]
    assert group.rewards == [0.0, -0.5, -1.0]
    assert group.completions[2].finish_reason == "length"


def test_truncated_completions_are_masked_out_of_the_update(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Completions that hit max_new_tokens leave the loss and its divisor (`tokens`), counted in
    `truncated_masked`; their groups' advantages were computed with them."""
    from _learner import one_rank, settings

    from sparkrl.services.learner.ledger import Batch

    rng = np.random.default_rng(4)
    groups = [random_group(rng, n=4, k=4, vocab_size=259, max_new_tokens=6) for _ in range(3)]
    truncated = [c for g in groups for c in g.completions if c.finish_reason == "length"]
    every = sum(c.num_tokens for g in groups for c in g.completions)
    assert truncated and len(truncated) < 12
    overrides = ["learner.skip_zero_advantage=false", "learner.loss.name=grpo"]
    trainer = one_rank(
        settings(tiny_model_dir, tmp_path, *overrides, "learner.mask_truncated_completions=true")
    )
    row = trainer.update(Batch(groups, []), 1, trainer.cfg).row()
    assert row["truncated_masked"] == len(truncated)
    assert row["tokens"] == every - sum(c.num_tokens for c in truncated)  # 6 tokens each
    plain = one_rank(settings(tiny_model_dir, tmp_path / "plain", *overrides))
    row = plain.update(Batch(groups, []), 1, plain.cfg).row()
    assert (row["truncated_masked"], row["tokens"]) == (0, every)
