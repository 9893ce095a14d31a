"""A rollout worker's settings: the `rollout` section; re-exported by `settings.py`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sparkrl.services.common.settings.engine import EngineSettings, SamplingSettings, TorchEngineSettings
from sparkrl.services.common.settings.section import Section
from sparkrl.services.common.settings.servers import MetricsEndpoint
from sparkrl.services.common.settings.supervision import WorkerHealthSettings


class OverlongBufferSettings(Section):
    """DAPO's soft over-long punishment (arXiv 2503.14476, eq. 13), added by the worker to each completion's
    score: 0 up to max_new_tokens − len tokens, then a linear ramp to −penalty_factor at max_new_tokens
    (`rollout/overlong_penalty_mean`, and each sample's `overlong_penalty` in samples.jsonl). verl:
    `reward_model.overlong_buffer.{enable, len, penalty_factor}`; TRL: `get_soft_overlong_punishment(
    max_completion_len, soft_punish_cache)`."""

    len: int | None = Field(
        None,
        ge=1,
        description="L_cache, the tokens before rollout.sampling.max_new_tokens over which the penalty "
        "ramps (verl overlong_buffer.len, TRL soft_punish_cache); None: no shaping.",
    )
    penalty_factor: float = Field(
        1.0,
        gt=0,
        le=100,
        description="The penalty at max_new_tokens (verl overlong_buffer.penalty_factor; DAPO's, TRL's 1).",
    )


class RolloutSettings(Section):
    """A rollout worker: engine, sampling, and its calls to the reward service."""

    worker_id: str | None = Field(None, description="Stable id (consumer name); None: hostname-pid.")
    python: str | None = Field(
        None,
        description="The interpreter `sparkrl up` starts workers with (a separate environment holding the "
        "`vllm` extra); None: the launcher's own.",
    )
    gpus: list[int] = Field(
        default_factory=list,
        description="GPUs for the workers, one each in turn (CUDA_VISIBLE_DEVICES); must not overlap "
        "learner.gpus. Empty: no placement.",
    )
    engine: EngineSettings = Field(default_factory=TorchEngineSettings, description="Generation engine.")
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    prompts_per_batch: int = Field(
        4, ge=1, le=1024, description="Prompts pulled and generated together (each yields one group)."
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Longest prompt (chat template applied), tokens; None: no limit."
    )
    overlong: Literal["drop", "truncate"] = Field(
        "drop",
        description="A longer prompt: dead-lettered with its length (drop), or cut to its last "
        "max_prompt_tokens tokens (truncate).",
    )
    lockstep_groups: int | None = Field(
        None,
        ge=1,
        description="Lockstep: after this many groups made with one policy version, wait for the next one "
        "(with learner.max_staleness 0: exactly on-policy; set it to learner.prompts_per_step / workers). "
        "None: asynchronous, workers run ahead within max_staleness.",
    )
    lockstep_wait_s: float = Field(
        60.0, gt=0, description="Lockstep: the longest wait for the next version before making more."
    )
    reward_timeout_s: float = Field(60.0, gt=0, description="HTTP timeout of one scoring call, seconds.")
    reward_retries: int = Field(
        10, ge=0, le=100, description="Retries (exponential backoff, at most 8 s apart) of a failed call."
    )
    reward_deadline_s: float = Field(
        120.0,
        gt=0,
        description="Longest a batch waits on the reward service, retries included; then its prompts are "
        "left to be reclaimed, seconds.",
    )
    heartbeat_s: float = Field(2.0, gt=0, le=60, description="Status heartbeat period, seconds.")
    model_wait_s: float = Field(
        600.0,
        gt=0,
        description="When the `model` directory is not there, how long to wait for the learner to announce "
        "its weight files (the model is fetched from it), seconds.",
    )
    overlong_buffer: OverlongBufferSettings = Field(
        default_factory=OverlongBufferSettings,
        description="Over-long reward shaping of completions near max_new_tokens (`rollout.overlong` is "
        "about prompts).",
    )
    health: WorkerHealthSettings = Field(
        default_factory=WorkerHealthSettings, description="A sick model is not a bad prompt."
    )
    metrics: MetricsEndpoint = Field(default_factory=MetricsEndpoint, description="/metrics and /healthz.")

    @model_validator(mode="after")
    def _buffer_inside_the_budget(self) -> RolloutSettings:
        budget, buffer = self.sampling.max_new_tokens, self.overlong_buffer.len
        if buffer is not None and buffer >= budget:
            raise ValueError(
                f"rollout.overlong_buffer.len {buffer} must be below rollout.sampling.max_new_tokens "
                f"({budget}): the penalty ramps over the last len tokens of the budget"
            )
        return self
