"""The generation engine seam: what a rollout worker needs from vLLM (GPU) or the torch loop (CPU).

Both engines satisfy the same contract, checked by `tests/test_engine_contract.py`:

- `generate` samples `sampling.n` completions per prompt and returns, for every generated token, its id,
  its log-prob under the temperature-scaled distribution `log_softmax(logits / T)` over the full
  vocabulary (before any top-p truncation: the distribution the learner recomputes), the top-k
  (ids, log-probs) of that same distribution sorted descending, and the engine's policy version.
- `load_weights` replaces weights in place between `generate` calls and sets the policy version; a
  version it cannot install raises before the engine changes (KeyError, ValueError) or after it undid the
  attempt (`WeightLoadFailed`): either way the engine still serves the version it held. An engine that
  could not undo it raises `EngineBroken` and refuses to generate.
- `weights_checksum` is `sparkrl.services.common.weight_sync.weights_checksum` (blake2b-256 over raw
  tensor bytes in state-dict order), the algorithm of the learner's `WeightAnnouncement.checksum`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from sparkrl.proto import Completion
from sparkrl.services.common.settings import SamplingSettings
from sparkrl.services.common.weight_sync import SyncFailed


class WeightLoadFailed(SyncFailed):
    """The engine did not install a version and still serves the one it held (a failed sync: the worker
    stays on its version and retries with the next one)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, epoch=-1, phase="verify")  # the engine's own load: outside any epoch

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.reason,))


class EngineBroken(Exception):
    """The engine holds no consistent version (a failed load could not be undone): it refuses to generate,
    and the worker must be restarted. Not a RuntimeError: no failed-sync handler may swallow it."""


class Engine(ABC):
    """A model that samples GRPO groups and swaps its weights between calls."""

    policy_version: int

    @property
    @abstractmethod
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's tokenizer (prompt encoding, stop strings, text of completions)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Rows of the output layer: every token id and top-k id is below it."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[list[Completion]]:
        """`sampling.n` completions for each prompt (token ids), in prompt order."""

    def check_request(self, prompts: list[list[int]], sampling: SamplingSettings) -> None:
        """Refuse, with a ValueError naming it, what no engine can sample: an empty prompt, a token id
        outside the vocabulary, more top-k entries than the vocabulary has. Each engine's `generate` calls
        it before any model work, so a bad request fails clearly and leaves the engine as it was."""
        if sampling.topk_logprobs > self.vocab_size:
            raise ValueError(
                f"topk_logprobs={sampling.topk_logprobs} exceeds the vocabulary ({self.vocab_size})"
            )
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if min(prompt) < 0 or max(prompt) >= self.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size})")

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy these (Hugging Face-named) tensors into the model in place; tag later tokens `version`."""

    @abstractmethod
    def weights_checksum(self) -> str:
        """blake2b-256 hex digest of the weights held, comparable with `WeightAnnouncement.checksum`."""

    @abstractmethod
    def close(self) -> None:
        """Free the model and any device memory or processes; the engine is unusable afterwards."""


def make_completion(
    token_ids: list[int] | np.ndarray,
    logprobs: np.ndarray,
    topk_ids: np.ndarray,
    topk_logprobs: np.ndarray,
    version: int,
    text: str,
    finish_reason: str,
) -> Completion:
    """A `Completion` with the wire dtypes; every token tagged with `version`."""
    token_ids = np.asarray(token_ids, dtype=np.int32)
    return Completion(
        token_ids=token_ids,
        logprobs=np.asarray(logprobs, dtype=np.float32),
        topk_ids=np.asarray(topk_ids, dtype=np.int32),
        topk_logprobs=np.asarray(topk_logprobs, dtype=np.float32),
        policy_versions=np.full(token_ids.shape[0], version, dtype=np.int32),
        text=text,
        finish_reason=finish_reason,
    )
