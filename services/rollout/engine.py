"""The generation engine seam: what a rollout worker needs from vLLM (GPU) or the torch loop (CPU).

Both engines satisfy the same contract, checked by `tests/test_engine_contract.py`:

- `generate` samples `sampling.n` completions per prompt and returns, for every generated token, its id,
  its log-prob under the temperature-scaled distribution `log_softmax(logits / T)` over the full
  vocabulary (before any top-p truncation: the distribution the learner recomputes), the top-k
  (ids, log-probs) of that same distribution sorted descending, and the engine's policy version.
- `generate(..., interrupts=)` calls `interrupts.poll()` between two decoding steps: there `load_weights`
  may install a newer version (every token sampled after it carries that version: `policy_versions`
  changes mid-completion), and a True answer stops the batch, its unfinished rows cut short
  (`finish_reason` "abort") with what they hold. `generate(..., prefixes=)` continues such rows instead of
  starting from the prompt: their tokens, log-probs and versions are kept, the cache recomputed.
- `load_weights` replaces weights in place between `generate` calls (or between two decoding steps, from
  `interrupts.poll`) and sets the policy version; a version it cannot install raises after it undid the
  attempt (`WeightLoadFailed`: the engine still serves the version it held). Tensors that do not fit the
  model (a name it does not have, another shape) raise `WeightsDoNotFit`, naming the tensor and the
  model's class: another model, or a family this engine cannot update, which no restart mends. An engine
  that could not undo a failed load raises `EngineBroken` and refuses to generate.
- A tied tensor (a head that is its embedding) arrives once, under its first state-dict name
  (`weight_sync.distinct_tensors`); the engine's own copy of it takes the values under every name.
- `weights_checksum` is `sparkrl.services.common.weight_sync.weights_checksum` (the tree of
  `sparkrl.proto.weights` over raw tensor bytes in state-dict order), the learner's
  `WeightAnnouncement.checksum`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

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


class WeightsDoNotFit(Exception):
    """The learner's tensors do not fit this engine's model: a name it lacks or a shape it does not have
    (the worker runs another model, or this engine's loader cannot take this family's tensors). The worker
    exits with `proto.run_files.EXIT_UNFIT` and the run ends with this message: no restart could help."""


class EngineBroken(Exception):
    """The engine holds no consistent version (a failed load could not be undone): it refuses to generate,
    and the worker must be restarted. Not a RuntimeError: no failed-sync handler may swallow it."""


Prefixes = list[list[Completion | None]]
"""Per prompt, one entry per sample (n): None (sample from the prompt), a completion cut short
(`finish_reason` "abort": continued from its last token) or a finished one (returned as it is)."""


@dataclass(frozen=True)
class Interrupts:
    """What an engine does between two decoding steps of a batch.

    `poll()` is called there (how often it looks at anything is its own business: it runs once per step).
    It may install a newer version with the engine's `load_weights`; every token sampled afterwards is
    tagged with it. It returns True to stop the batch now: the rows not finished come back cut short.
    `kv_cache` is what a swap does to the cache of the tokens sampled before it: `keep` (PipelineRL's
    choice: the next tokens attend to keys and values the old weights computed, so they are sampled from
    a mixture that neither version alone gives; their recorded log-probs are that mixture's, which is what
    the learner's importance ratios divide by) or `recompute` (prompt and tokens so far are run again
    under the new weights before the next step: every later token is exactly the new version's sample).
    """

    poll: Callable[[], bool]
    kv_cache: Literal["keep", "recompute"] = "keep"


class Engine(ABC):
    """A model that samples GRPO groups and swaps its weights between calls."""

    policy_version: int
    continues_prefixes: bool = False  # generate(prefixes=) continues cut-short samples; else refuses them
    whole_versions: bool = False  # load_weights takes every tensor at once (vLLM); else any subset
    serves_adapters: bool = False  # load_adapter serves a LoRA version as it is (vLLM's LoRA), no merge

    @property
    @abstractmethod
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's tokenizer (prompt encoding, stop strings, text of completions)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Rows of the output layer: every token id and top-k id is below it."""

    @abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingSettings,
        *,
        prefixes: Prefixes | None = None,
        interrupts: Interrupts | None = None,
    ) -> list[list[Completion]]:
        """`sampling.n` completions for each prompt (token ids), in prompt order. `prefixes`: samples to
        continue (see `Prefixes`); `interrupts`: called between decoding steps (see `Interrupts`)."""

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

    def check_prefixes(
        self, prompts: list[list[int]], sampling: SamplingSettings, prefixes: Prefixes | None
    ) -> None:
        """Refuse, with a ValueError naming it, prefixes that do not fit the request: not n per prompt,
        another top-k width, a continued one already at max_new_tokens, ids outside the vocabulary."""
        if prefixes is None:
            return
        if len(prefixes) != len(prompts):
            raise ValueError(f"{len(prefixes)} prefix lists for {len(prompts)} prompts")
        for i, samples in enumerate(prefixes):
            if len(samples) != sampling.n:
                raise ValueError(f"prompt {i} has {len(samples)} prefixes, sampling.n is {sampling.n}")
            for j, prefix in enumerate(samples):
                if prefix is None:
                    continue
                where = f"prefix {j} of prompt {i}"
                if prefix.topk_ids.shape[1] != sampling.topk_logprobs:
                    raise ValueError(f"{where} has top-{prefix.topk_ids.shape[1]}, the request asks for "
                                     f"top-{sampling.topk_logprobs}")  # fmt: skip
                if prefix.num_tokens > sampling.max_new_tokens or (
                    prefix.finish_reason == "abort" and prefix.num_tokens == sampling.max_new_tokens
                ):
                    raise ValueError(f"{where} has {prefix.num_tokens} tokens: nothing left to sample "
                                     f"within max_new_tokens={sampling.max_new_tokens}")  # fmt: skip
                if prefix.num_tokens and int(prefix.token_ids.max()) >= self.vocab_size:
                    raise ValueError(f"{where} has token ids outside [0, {self.vocab_size})")

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy these (Hugging Face-named) tensors into the model in place; tag later tokens `version`."""

    def load_adapter(self, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        """Serve `adapter` (`<layer>.lora_A` / `.lora_B`, scaling folded in) over the base from now on;
        only where `serves_adapters` (install.py merges it for the others)."""
        raise WeightLoadFailed(f"{type(self).__name__} serves no LoRA adapters: merge the version instead")

    @abstractmethod
    def weights_checksum(self) -> str:
        """The weights checksum (hex) of the weights held, comparable with `WeightAnnouncement.checksum`."""

    @abstractmethod
    def close(self) -> None:
        """Free the model and any device memory or processes; the engine is unusable afterwards."""


def make_completion(
    token_ids: list[int] | np.ndarray,
    logprobs: np.ndarray,
    topk_ids: np.ndarray,
    topk_logprobs: np.ndarray,
    version: int | np.ndarray,
    text: str,
    finish_reason: str,
) -> Completion:
    """A `Completion` with the wire dtypes; `version`: every token's (an int), or each token's ([T])."""
    token_ids = np.asarray(token_ids, dtype=np.int32)
    versions = np.broadcast_to(np.asarray(version, dtype=np.int32), token_ids.shape)
    return Completion(
        token_ids=token_ids,
        logprobs=np.asarray(logprobs, dtype=np.float32),
        topk_ids=np.asarray(topk_ids, dtype=np.int32),
        topk_logprobs=np.asarray(topk_logprobs, dtype=np.float32),
        policy_versions=np.ascontiguousarray(versions),
        text=text,
        finish_reason=finish_reason,
    )


def cut_short(prefix: Completion | None, k: int) -> Completion:
    """A sample a stopped batch never got to: its prefix as it was (or nothing yet), cut short."""
    if prefix is not None:
        return prefix.model_copy(update={"finish_reason": "abort"})
    empty = np.zeros(0, dtype=np.int32)
    return make_completion(empty, np.zeros(0), np.zeros((0, k)), np.zeros((0, k)), 0, "", "abort")


def finished(prefix: Completion | None) -> bool:
    """Whether a prefix needs no more sampling (it ended with EOS, a stop string or at max_new_tokens)."""
    return prefix is not None and prefix.finish_reason != "abort"
