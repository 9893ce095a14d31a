"""Random valid messages for tests and benchmarks, shaped like what a real rollout worker publishes."""

import numpy as np

from sparkrl.proto.group import TrajectoryGroup
from sparkrl.proto.reward import RewardResult
from sparkrl.proto.trajectory import Completion, Prompt, SamplingParams, group_id_for

_WORDS = ("the", "answer", "is", "wait", "however", "perhaps", "so", "=", "+", "24", "\n")


def random_topk(rng: np.random.Generator, T: int, k: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A realistic top-k: ids int32 [T, k] distinct per row, log-probs float32 [T, k] sorted descending.

    The log-probs are a peaked distribution normalized together with a tail mass for the rest of the
    vocabulary, so each row's probabilities sum below 1, as a real top-k over the full vocabulary does.
    """
    if k > vocab_size:
        raise ValueError(f"k={k} exceeds vocab_size={vocab_size}")
    gaps = rng.exponential(1.5, size=(T, k))  # [T, k]
    gaps[:, :1] = 0.0
    scores = -np.cumsum(gaps, axis=1)  # [T, k], descending from 0
    tail = (scores[:, -1] if k else np.zeros(T)) + rng.normal(0.0, 1.0, size=T)  # [T] rest of vocab
    log_z = np.logaddexp(np.logaddexp.reduce(scores, axis=1) if k else -np.inf, tail)  # [T]
    # float32 rounding is monotone, so the cast keeps the order (ties at worst).
    logprobs = (scores - log_z[:, None]).astype(np.float32)
    # Distinct ids per row: strictly increasing offsets that span less than the vocabulary.
    step = rng.integers(1, vocab_size // max(k, 1) + 1, size=(T, k))  # [T, k]
    step[:, :1] = 0
    base = rng.integers(0, vocab_size, size=(T, 1))
    ids = ((base + np.cumsum(step, axis=1)) % vocab_size).astype(np.int32)
    return ids, logprobs


def random_completion(
    rng: np.random.Generator, T: int, k: int, vocab_size: int, version: int, max_new_tokens: int
) -> Completion:
    """A completion that samples from its own top-k (or the tail), possibly swapping weights midway."""
    topk_ids, topk_logprobs = random_topk(rng, T, k, vocab_size)
    probs = np.exp(topk_logprobs.astype(np.float64))  # [T, k]
    choice = (rng.random(size=(T, 1)) > np.cumsum(probs, axis=1)).sum(axis=1)  # [T] in [0, k]; k = tail
    in_topk = choice < k
    rows = np.arange(T)
    picked = np.minimum(choice, max(k - 1, 0))
    token_ids = rng.integers(0, vocab_size, size=T).astype(np.int32)
    logprobs = np.full(T, -float(np.log(vocab_size)) - 2.0, dtype=np.float32)
    if k:
        token_ids[in_topk] = topk_ids[rows, picked][in_topk]
        logprobs[in_topk] = topk_logprobs[rows, picked][in_topk]
    swap = int(rng.integers(0, T)) if T and rng.random() < 0.3 else T
    policy_versions = np.where(np.arange(T) < swap, version, version + 1).astype(np.int32)
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        topk_ids=topk_ids,
        topk_logprobs=topk_logprobs,
        policy_versions=policy_versions,
        text=" ".join(_WORDS[i % len(_WORDS)] for i in token_ids.tolist()),
        finish_reason="length" if T == max_new_tokens else "stop",
    )


def random_group(
    rng: np.random.Generator,
    n: int = 8,
    T: int | None = None,
    k: int = 20,
    vocab_size: int = 151936,
    max_new_tokens: int = 1024,
) -> TrajectoryGroup:
    """A valid group of `n` completions: all of length `T`, or of random lengths in [1, max_new_tokens]."""
    max_new_tokens = max(max_new_tokens, T or 0)
    lengths = [T] * n if T is not None else rng.integers(1, max_new_tokens + 1, size=n).tolist()
    version = int(rng.integers(0, 1000))
    prompt_id = f"random/{int(rng.integers(0, 2**62))}@0"
    numbers = rng.integers(1, 100, size=4).tolist()
    scores = rng.integers(0, 2, size=n).astype(float).tolist()
    created = 1.7e9 + float(rng.random()) * 1e6
    return TrajectoryGroup(
        group_id=group_id_for(prompt_id),
        prompt=Prompt(
            prompt_id=prompt_id,
            task="countdown",
            text=f"Using the numbers {numbers}, make 24. Answer:",
            task_data={"numbers": numbers, "target": 24},
            source="random",
        ),
        prompt_token_ids=rng.integers(0, vocab_size, size=int(rng.integers(1, 257))).astype(np.int32),
        completions=[random_completion(rng, Ti, k, vocab_size, version, max_new_tokens) for Ti in lengths],
        rewards=scores,
        reward_details=[
            RewardResult(score=s, status="correct" if s else "incorrect", elapsed_s=0.001) for s in scores
        ],
        task="countdown",
        producer="worker-0",
        vocab_size=vocab_size,
        topk=k,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens),
        created_at=created,
        scored_at=created + 5.0,
        published_at=created + 5.1,
    )
