"""A multi-turn episode's environment tokens on the wire and in the learner (issue 48, item 3): they travel
as `environment_spans`, are context for the model's later tokens and reach no loss, count or Lp-Reg
percentile. The learner's side is checked by the gradient: an episode whose last turn is the environment's
trains exactly as the same episode without that turn (under causal attention the model's tokens see the
same context either way), for every loss and aggregation; were the environment's tokens counted, the token
mean's divisor, Lp-Reg's k and the percentile would move it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _learner import assert_same_gradient, gradient_and_stats, one_rank, settings
from _tiny import tiny_model_dir  # noqa: F401  (fixture)

from sparkrl.proto import Completion, TrajectoryGroup, decode_group, encode_group
from sparkrl.proto.errors import CodecError
from sparkrl.proto.testing import random_group
from sparkrl.services.common.modeling import load_model
from sparkrl.services.learner.batch import collate, pack, samples_from_groups

VOCAB = 260  # the tiny model's byte-level vocabulary


def with_environment_turn(completion: Completion, tokens: list[int], at: int | None = None) -> Completion:
    """`completion` with the environment's `tokens` inserted at position `at` (default: the end), as a
    worker writes them: log-prob 0, top-k the token itself at 0."""
    at = completion.num_tokens if at is None else at
    K, m = completion.topk_ids.shape[1], len(tokens)
    ids = np.asarray(tokens, dtype=np.int32)

    def spliced(array: np.ndarray, middle: np.ndarray) -> np.ndarray:
        return np.concatenate([array[:at], middle.astype(array.dtype), array[at:]])

    version = completion.policy_versions[max(at - 1, 0)] if completion.num_tokens else 0
    moved = [(s + m, e + m) if s >= at else (s, e) for s, e in completion.environment_spans or ()]
    return completion.model_copy(
        update={
            "token_ids": spliced(completion.token_ids, ids),
            "logprobs": spliced(completion.logprobs, np.zeros(m)),
            "policy_versions": spliced(completion.policy_versions, np.full(m, version)),
            "topk_ids": spliced(completion.topk_ids, np.repeat(ids[:, None], K, axis=1)),
            "topk_logprobs": spliced(completion.topk_logprobs, np.zeros((m, K))),
            "environment_spans": sorted([*moved, (at, at + m)]),
        }
    )


def _groups(seed: int, count: int = 6) -> list[TrajectoryGroup]:
    """Groups of 4 answers of 1-12 tokens, each sampled at about the untrained model's log-prob (so that
    importance weights against the learner's are near 1, not vanishing)."""
    rng = np.random.default_rng(seed)
    groups = []
    for index in range(count):
        group = random_group(rng, n=4, k=8, vocab_size=VOCAB, max_new_tokens=12)
        prompt = group.prompt_token_ids[: int(rng.integers(3, 14))]
        rewards = [0.0] * 4 if index % 3 == 1 else [float(r) for r in rng.integers(0, 2, size=4)]
        completions = [
            c.model_copy(update={"logprobs": rng.uniform(-6.0, -5.0, c.num_tokens).astype(np.float32)})
            for c in group.completions
        ]
        update = {"prompt_token_ids": prompt, "rewards": rewards, "completions": completions}
        groups.append(group.model_copy(update=update))
    return groups


def _with_tails(groups: list[TrajectoryGroup], seed: int) -> list[TrajectoryGroup]:
    """Every completion followed by an environment turn of 3-9 tokens."""
    rng = np.random.default_rng(seed)
    return [
        group.model_copy(
            update={
                "completions": [
                    with_environment_turn(c, rng.integers(0, VOCAB, size=int(rng.integers(3, 10))).tolist())
                    for c in group.completions
                ]
            }
        )
        for group in groups
    ]


def test_spans_travel_and_bad_spans_are_refused_naming_the_field() -> None:
    group = _groups(0, count=1)[0]
    first = next(c for c in group.completions if c.num_tokens >= 2)
    first = with_environment_turn(first, [5, 6, 7], at=2)
    first = with_environment_turn(first, [8, 9], at=first.num_tokens)
    assert first.environment_spans == [(2, 5), (first.num_tokens - 2, first.num_tokens)]
    assert first.model_tokens == first.num_tokens - 5
    T = first.num_tokens
    assert first.model_token_mask().tolist() == [not (2 <= i < 5 or i >= T - 2) for i in range(T)]
    sent = group.model_copy(update={"completions": [first, *group.completions[1:]]})
    back = decode_group(encode_group(sent))
    assert back.completions[0].environment_spans == first.environment_spans
    assert back.completions[1].environment_spans is None
    for spans, says in [
        ([(0, 0)], "environment_spans[0]"),
        ([(3, 4), (2, 5)], "environment_spans[1]"),
        ([(0, first.num_tokens + 1)], "environment_spans[0]"),
    ]:
        with pytest.raises(ValueError, match=says.replace("[", r"\[")):
            Completion.model_validate(first.model_dump() | {"environment_spans": spans})
    wire = encode_group(sent)
    assert wire.count(b"\x92\x02\x05") == 1  # the span [2, 5) in the msgpack header
    with pytest.raises(CodecError, match="environment_spans"):  # one that runs past T, written by hand
        decode_group(wire.replace(b"\x92\x02\x05", b"\x92\x02\x7f"))


def test_a_model_turn_longer_than_the_budget_is_refused_an_episode_is_not() -> None:
    group = _groups(1, count=1)[0]
    budget = group.sampling.max_new_tokens
    first = group.completions[0]
    long_episode = with_environment_turn(first, list(range(budget)), at=1)
    assert long_episode.num_tokens > budget
    TrajectoryGroup.model_validate({**dict(group), "completions": [long_episode, *group.completions[1:]]})
    arrays = ("token_ids", "logprobs", "policy_versions", "topk_ids", "topk_logprobs")
    longer = first.model_copy(update={name: np.concatenate([getattr(first, name)] * 13) for name in arrays})
    with pytest.raises(ValueError, match="a model turn of T="):
        TrajectoryGroup.model_validate(
            {**dict(group), "completions": [with_environment_turn(longer, [1, 2]), *group.completions[1:]]}
        )


def test_the_micro_batch_trains_the_models_tokens_only() -> None:
    groups = _groups(2)
    plain, tailed = samples_from_groups(groups), samples_from_groups(_with_tails(groups, 3))
    for batch in (collate, lambda s, pad_id: pack(s, pad_id=pad_id, row_length=64)):
        want, got = batch(plain, pad_id=0), batch(tailed, pad_id=0)
        assert got.num_tokens == want.num_tokens == sum(s.num_tokens for s in plain)
        assert int(got.attention_mask.sum()) > int(want.attention_mask.sum())  # the tails are context
        assert sorted(got.rollout_logp[got.mask].tolist()) == sorted(want.rollout_logp[want.mask].tolist())
    assert all(t.num_tokens == p.num_tokens < t.length for p, t in zip(plain, tailed, strict=True))


CASES = {
    "lp_reg": ["learner.loss.name=lp_reg", "learner.loss.rho=0.3"],
    "lp_reg, packed": ["learner.loss.name=lp_reg", "learner.loss.rho=0.3", "learner.pack_length=64"],
    "grpo, sequence means": ["learner.loss.name=grpo", "learner.loss_aggregation=seq_mean_token_mean"],
    "grpo, recomputed old log-probs, sequence-level TIS": [
        "learner.loss.name=grpo",
        "learner.old_logp_source=recompute",
        "learner.tis_level=sequence",
    ],
    "gspo": ["learner.loss.name=gspo"],
}


@torch.no_grad()
def _at_the_models_logprobs(groups: list[TrajectoryGroup], model_dir: Path) -> list[TrajectoryGroup]:
    """The groups as if the model in `model_dir` had sampled them: each token's rollout log-prob its own
    (importance weights of 1, whatever the build of the tiny model: a sequence-level weight over tokens
    a trained model finds unlikely vanishes, and with it the gradient the test compares)."""
    model = load_model(model_dir, "float32", "cpu").eval()
    out = []
    for group in groups:
        prompt, completions = group.prompt_token_ids.tolist(), []
        for c in group.completions:
            ids = torch.tensor([prompt + c.token_ids.tolist()])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
            own = logp.gather(1, torch.from_numpy(c.token_ids).long()[:, None]).squeeze(1)
            completions.append(c.model_copy(update={"logprobs": own.numpy().astype(np.float32)}))
        out.append(group.model_copy(update={"completions": completions}))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_environment_tokens_add_nothing_to_the_gradient_or_the_counts(
    case: str,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    # One micro-batch: the environment's tokens lengthen the rows, and so may change how samples fall into
    # micro-batches (a sequence-level loss and Lp-Reg's k are per micro-batch), which is not what is tested.
    base = ["learner.micro_batch_tokens=100000", "learner.lr=1e-3", "learner.proxy_kappa=0.5"]
    trainer = one_rank(settings(tiny_model_dir, tmp_path, *base, *CASES[case]))
    groups = _at_the_models_logprobs(_groups(4), tiny_model_dir)
    want_grads, want = gradient_and_stats(trainer, groups)
    got_grads, got = gradient_and_stats(trainer, _with_tails(groups, 5))
    assert got["tokens"] == want["tokens"] > 0
    # Rows of other lengths sum in other orders: float32 noise of a few 1e-6 where the weights are 1 (a
    # counted environment token moves the gradient by percents).
    assert_same_gradient(got_grads, want_grads, atol=1e-5)
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
    assert got["entropy"] == pytest.approx(want["entropy"], abs=1e-5)
    if trainer.cfg.loss.name == "lp_reg":
        assert got["reg_tokens"] == want["reg_tokens"] > 0


def test_a_split_episodes_next_sample_opens_with_context() -> None:
    """A split episode's later sample starts with the history re-rendered (environment tokens at 0): it is
    a valid completion, its model turns are the ones after, and the micro-batch trains those only."""
    groups = _groups(6, count=2)
    opened = [
        group.model_copy(
            update={"completions": [with_environment_turn(c, [7, 8, 9], at=0) for c in group.completions]}
        )
        for group in groups
    ]
    back = [decode_group(encode_group(g)) for g in opened]
    for plain, split in zip(groups, back, strict=True):
        for c, s in zip(plain.completions, split.completions, strict=True):
            assert s.environment_spans == [(0, 3)] and s.model_turns() == [c.num_tokens]
    plain_batch = collate(samples_from_groups(groups), pad_id=0)
    split_batch = collate(samples_from_groups(back), pad_id=0)
    assert split_batch.num_tokens == plain_batch.num_tokens
    assert sorted(split_batch.rollout_logp[split_batch.mask].tolist()) == sorted(
        plain_batch.rollout_logp[plain_batch.mask].tolist()
    )
