"""How a worker samples and which engine generates: the `rollout.sampling` and `rollout.engine` sections
of the settings; re-exported by `settings.py`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from sparkrl.services.common.settings_section import Section


class SamplingSettings(Section):
    """How a worker samples each GRPO group."""

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
    seed: int | None = Field(None, description="Sampling seed; None draws one per worker.")

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
    """vLLM on GPU (install the `vllm` extra in its own environment)."""

    kind: Literal["vllm"] = "vllm"
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1, description="Fraction of GPU memory vLLM may take."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine.")
    max_model_len: int | None = Field(None, ge=16, description="Context length; None: the model's.")
    enforce_eager: bool = Field(False, description="Disable CUDA graphs (slower, starts faster).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("auto", description="Weights' dtype.")


EngineSettings = Annotated[TorchEngineSettings | VllmEngineSettings, Field(discriminator="kind")]
