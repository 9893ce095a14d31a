"""The GPU engine: vLLM (its V1 engine and `LLM` API), same contract as the torch engine.

vLLM is imported lazily, inside the methods that need it: it pins its own torch and lives in its own
environment (the `vllm` extra); CPU code and tests never import it.

Facts of vLLM's API this relies on (vllm/v1/sample/sampler.py, ops/topk_topp_sampler.py,
vllm/entrypoints/llm.py, v1/engine/parallel_sampling.py, examples/offline_inference/rlhf_utils.py):

- `logprobs_mode="processed_logprobs"`: log-probs are `log_softmax` of the logits after temperature and
  after top-k/top-p masking. The default `raw_logprobs` is the model's T=1 distribution, wrong for us at
  any other temperature. With top-p off, processed = `log_softmax(logits / T)`, the contract's
  distribution; with top-p on, processed is the truncated one, so `generate` refuses top_p < 1 (the
  learner could not recompute it, and both engines must report the same quantity).
- `SamplingParams(logprobs=k)` returns, per generated token, a dict token_id → Logprob(logprob, rank)
  holding the top-k *and* the sampled token (k or k + 1 entries); `max_logprobs` caps k at start-up.
- With `seed`, child j of an `n`-sample request samples with `seed + j`, so prompt i gets `seed + i * n`.
- `worker_extension_cls` mixes a class into every GPU worker; `LLM.collective_rpc(name, args=...)` calls
  its method on each of them, where `self.model_runner.model.load_weights(weights=[(name, tensor)])`
  loads Hugging Face-named tensors (fusing q/k/v and gate/up, sharding for tensor parallelism).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from sparkrl.proto import Completion
from sparkrl.services.common.modeling import load_tokenizer
from sparkrl.services.common.settings import SamplingSettings, VllmEngineSettings
from sparkrl.services.common.weight_sync import weights_checksum
from sparkrl.services.rollout.engine import Engine, make_completion
from sparkrl.services.rollout.vllm_transfer import NativeTransferExtension

MAX_TOPK = 1024  # SamplingSettings.topk_logprobs' upper bound; vLLM rejects k above max_logprobs
RPC_BUCKET_BYTES = 256 << 20  # tensors per collective_rpc message: bounds the pickled payload
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


class SparkrlWorkerExtension(NativeTransferExtension):
    """Mixed into each vLLM GPU worker (`worker_extension_cls`); called through `collective_rpc`. The
    native transfer's methods (`sync.backend: vllm_nccl`) come from `NativeTransferExtension`."""

    model_runner: Any
    device: torch.device

    def sparkrl_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Load Hugging Face-named tensors in place; the model's own loader fuses and shards them."""
        model = self.model_runner.model
        model.load_weights(weights=[(name, tensor.to(self.device)) for name, tensor in weights])
        # The next generate step must not read weights still being copied.
        torch.cuda.synchronize()
        return len(weights)


def _buckets(
    named_tensors: list[tuple[str, torch.Tensor]], limit: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach().to("cpu").contiguous()))
        size += nbytes
    if bucket:
        yield bucket


def checkpoint_state_dict(model_path: Path) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in the Hugging Face model's state-dict order (the learner's broadcast
    order), tied names resolved to the tensor they share; read from the safetensors files on CPU."""
    from safetensors import safe_open

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    live = skeleton.state_dict(keep_vars=True)
    stored: dict[str, torch.Tensor] = {}
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as shard:
            stored.update({name: shard.get_tensor(name) for name in shard.keys()})
    # A tied weight (lm_head sharing embed_tokens) is stored once, under one of its names.
    stored_name = {id(tensor): name for name, tensor in live.items() if name in stored}
    return [(name, stored[stored_name[id(tensor)]]) for name, tensor in live.items()]


class VllmEngine(Engine):
    """`vllm.LLM` on this process's GPUs; weights swapped in place between `generate` calls."""

    model_path: Path
    settings: VllmEngineSettings
    llm: Any  # vllm.LLM
    _tokenizer: PreTrainedTokenizerBase
    _vocab_size: int
    _checksum: str | None

    def __init__(
        self, model_path: str | Path, settings: VllmEngineSettings, *, native_transfer: bool = False
    ) -> None:
        """`native_transfer`: start vLLM's NCCL weight-transfer engine (`sync.backend: vllm_nccl`; the
        weights then arrive through `vllm_transfer.VllmNativeReceiver`, not `load_weights`)."""
        from vllm import LLM

        self.model_path = Path(model_path)
        self.settings = settings
        self.policy_version = 0
        self._tokenizer = load_tokenizer(self.model_path)
        self._vocab_size = int(AutoConfig.from_pretrained(self.model_path, local_files_only=True).vocab_size)
        self._checksum: str | None = None  # of the checkpoint, computed on first request
        transfer: dict[str, Any] = {}
        if native_transfer:
            from vllm.config import WeightTransferConfig

            # What `vllm serve --weight-transfer-config '{"backend": "nccl"}'` sets.
            transfer["weight_transfer_config"] = WeightTransferConfig(backend="nccl")
        self.llm = LLM(
            model=str(self.model_path),
            tokenizer=str(self.model_path),
            dtype=settings.dtype,
            tensor_parallel_size=settings.tensor_parallel_size,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_model_len=settings.max_model_len,
            enforce_eager=settings.enforce_eager,
            enable_prefix_caching=True,  # GRPO: n samples share a prompt
            max_logprobs=MAX_TOPK,
            # Overrides the default raw_logprobs (T=1, before processing): see the module docstring.
            logprobs_mode="processed_logprobs",
            # Ignore the checkpoint's generation_config.json: sampling comes from SamplingSettings only.
            generation_config="vllm",
            worker_extension_cls=f"{__name__}.SparkrlWorkerExtension",
            **transfer,
        )

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _sampling_params(self, sampling: SamplingSettings, prompt_index: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=1.0,
            max_tokens=sampling.max_new_tokens,
            stop=list(sampling.stop) or None,
            include_stop_str_in_output=False,
            skip_special_tokens=True,
            # Distinct streams per prompt: children of prompt i use seed + i * n + j.
            seed=None if sampling.seed is None else sampling.seed + prompt_index * sampling.n,
            logprobs=sampling.topk_logprobs,
        )

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        if sampling.min_new_tokens > 0:
            raise ValueError(
                "the vLLM engine's processed log-probs would carry min_new_tokens' EOS mask (vLLM's "
                "min-tokens processor runs before they are taken); set sampling.min_new_tokens = 0, or use "
                "the torch engine"
            )
        if sampling.top_p < 1.0:
            raise ValueError(
                "the vLLM engine reports log-probs of the top-p-truncated distribution (processed_logprobs); "
                "set sampling.top_p = 1.0 so they are log_softmax(logits / T), as the learner recomputes"
            )
        if sampling.topk_logprobs > MAX_TOPK:
            raise ValueError(f"topk_logprobs={sampling.topk_logprobs} exceeds max_logprobs={MAX_TOPK}")
        version = self.policy_version
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts],
            [self._sampling_params(sampling, i) for i in range(len(prompts))],
            use_tqdm=False,
        )
        return [
            [self._completion(sample, sampling.topk_logprobs, version) for sample in output.outputs]
            for output in outputs  # LLM.generate returns them in prompt order
        ]

    @staticmethod
    def _completion(sample: Any, k: int, version: int) -> Completion:
        """A vLLM `CompletionOutput` → `Completion`; the sampled token's entry may lie outside the top-k."""
        token_ids = list(sample.token_ids)
        T = len(token_ids)
        logprobs = np.empty(T, dtype=np.float32)
        topk_ids = np.empty((T, k), dtype=np.int32)
        topk_logprobs = np.empty((T, k), dtype=np.float32)
        for t, (token, entries) in enumerate(zip(token_ids, sample.logprobs or [], strict=True)):
            logprobs[t] = entries[token].logprob
            # Sorted by value, not by vLLM's rank: the extra sampled entry (rank > k) falls off the end.
            best = sorted(entries.items(), key=lambda item: item[1].logprob, reverse=True)[:k]
            if len(best) < k:
                raise RuntimeError(f"vLLM returned {len(best)} log-probs at position {t}, expected {k}")
            topk_ids[t] = [token_id for token_id, _ in best]
            topk_logprobs[t] = [entry.logprob for _, entry in best]
        # vLLM finishes with stop (EOS or stop string), length or abort; anything else was cut short too.
        reason = _FINISH_REASONS.get(sample.finish_reason, "abort")
        return make_completion(token_ids, logprobs, topk_ids, topk_logprobs, version, sample.text, reason)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Send the tensors to every worker in buckets, then drop the prefix cache (its KV came from the
        old weights). Pass the whole state dict in the learner's order: the checksum covers this call."""
        tensors = list(named_tensors)
        for bucket in _buckets(tensors, RPC_BUCKET_BYTES):
            self.llm.collective_rpc("sparkrl_load_weights", args=(bucket,))
        self.llm.reset_prefix_cache()
        self._checksum = weights_checksum(tensors)
        self.policy_version = version

    def weights_arrived(self, version: int, checksum: str) -> None:
        """Weights loaded by vLLM's native transfer (`vllm_transfer.py`), every GPU worker having hashed
        them to `checksum` as it loaded them: drop the prefix cache, take the version."""
        self.llm.reset_prefix_cache()
        self._checksum = checksum
        self.policy_version = version

    def weights_checksum(self) -> str:
        """Of the tensors last loaded, in the order given (the announced version, when the worker passes
        the receiver's state dict); before any load, of the checkpoint in state-dict order. vLLM's own
        parameters are fused and sharded, so they cannot be hashed back into the learner's layout."""
        if self._checksum is None:
            self._checksum = weights_checksum(checkpoint_state_dict(self.model_path))
        return self._checksum

    def close(self) -> None:
        # The V1 engine core process and its workers shut down when the LLM is collected.
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
