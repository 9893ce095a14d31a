"""A rollout worker's settings: the `rollout` section; re-exported by `settings.py`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sparkrl.proto.codec import WireFloat
from sparkrl.services.common.settings.engine import (
    EngineSettings,
    SamplingSettings,
    TorchEngineSettings,
    VllmEngineSettings,
)
from sparkrl.services.common.settings.prompt_format import (
    ChatTemplateMode,
    PromptFormat,
    TemplateKwargs,
    same_format_field,
)
from sparkrl.services.common.settings.section import Section
from sparkrl.services.common.settings.servers import (
    KEEPS_REWARD,
    SHIPPED_ENVIRONMENTS,
    MetricsEndpoint,
    environment_name,
)
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


class WireSettings(Section):
    """How a worker's groups travel to the learner (issue 50, item 3): the log-prob fields' precision. Ids
    always travel as narrow as the vocabulary allows (uint16 up to 65,536 tokens: lossless). Measured
    (`bench/wire_bench.py`, docs/benchmarks.md): top-k log-probs in float16 cut the bytes a token by a
    quarter (V = 151,936) to nearly half (the demo) and move Lp-Reg's loss by ~1e-5 and its gradient by
    ~1e-4 relative, selecting the same tokens; bfloat16 changed which tokens were regularized, and the
    sampled log-probs (each ratio's denominator) in float16 moved the gradient 4-6x more."""

    logprobs: WireFloat = Field(
        "float32",
        description="The sampled tokens' log-probs (π_old in every ratio): float32, float16 or bfloat16.",
    )
    topk_logprobs: WireFloat = Field(
        "float16",
        description="The top-k log-probs (Lp-Reg's proxy): float32, float16 (rounded to nearest, clipped "
        "to its finite range) or bfloat16.",
    )


class InFlightSettings(Section):
    """How a worker with `weight_updates: in_flight` takes a version between two decoding steps."""

    kv_cache: Literal["keep", "recompute"] = Field(
        "keep",
        description="The cache of the tokens sampled before the swap: keep (PipelineRL's choice; the next "
        "tokens are sampled by the new weights on the old weights' keys and values, their log-probs those of "
        "that mixture, which the learner's ratios correct) or recompute (prompt and tokens so far are run "
        "again under the new weights: later tokens are exactly the new version's samples, at the cost of "
        "one prefill per swap).",
    )
    poll_s: float = Field(
        0.05,
        gt=0,
        le=10,
        description="How often, during generation, the worker looks for a newer announcement (a Redis read), "
        "seconds.",
    )


class PartialSettings(Section):
    """Partial rollouts: a worker that stops mid-generation hands what it has over instead of dropping it."""

    enabled: bool = Field(
        True,
        description="A stopped worker (a signal, a stop command, scaled down) or one that fails a weight "
        "sync mid-generation stops at the next decoding step, saves its unfinished groups (prompt, tokens "
        "so far with their versions and log-probs, the samples finished) and releases their prompts; the "
        "worker that takes a prompt next continues its samples instead of starting from the prompt. "
        "false: the batch in hand is finished first, and a prompt taken over is made from scratch.",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="A saved sample is continued only when its oldest token is at most this many versions "
        "older than the version the continuing worker holds (else it is made again from the prompt, "
        "counted); None: the learner's max_staleness in force, from its status.",
    )
    ttl_s: float = Field(
        86_400.0,
        gt=0,
        description="How long saved partial work is kept for its prompt's next worker, seconds (a prompt is "
        "reclaimed within bus.claim_idle_ms; this only bounds what a run that stopped leaves in Redis).",
    )


class AgentSettings(Section):
    """Multi-turn episodes with an environment (docs/agents.md): each sample of a group is an episode."""

    environment: str | None = Field(
        None,
        description="The environment each episode plays: a shipped one by name (calculator, python, "
        "countdown_retry, lookup) or your own class as `package.module:Class` (importable where the "
        "episodes run; docs/agents.md). None: one completion per sample, no environment.",
    )
    url: str | None = Field(
        None,
        description="An environment service's base URL (`sparkrl env`, e.g. http://127.0.0.1:8300): the "
        "episodes' environments run there, not in the worker. None: in the worker's process.",
    )
    max_turns: int = Field(4, ge=1, le=64, description="Model turns per episode at most (then `max_turns`).")
    max_tokens: int = Field(
        2048,
        ge=16,
        description="An episode's whole context at most, prompt and every turn, tokens (then `max_tokens`); "
        "each model turn is also held to sampling.max_new_tokens.",
    )
    reward: Literal["verifier", "environment", "sum"] = Field(
        "verifier",
        description="What trains: the reward service's verdict on the model's last turn (verifier), the "
        "environment's get_reward() (environment), or both added (sum).",
    )

    @model_validator(mode="after")
    def _reward_the_environment_keeps(self) -> AgentSettings:
        if self.url is not None and self.environment is None:
            raise ValueError(
                "rollout.agent.url is set but rollout.agent.environment is not: name the environment"
            )
        if self.environment is not None:
            environment_name(self.environment)
        shipped = self.environment in SHIPPED_ENVIRONMENTS
        if self.reward != "verifier" and shipped and self.environment not in KEEPS_REWARD:
            raise ValueError(
                f"rollout.agent.reward {self.reward}: the {self.environment} environment keeps no reward "
                f"(no get_reward; those that do: {', '.join(sorted(KEEPS_REWARD))}); use verifier"
            )  # your own environment's get_reward is looked for where it is loaded (environments.py)
        return self


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
    wire: WireSettings = Field(default_factory=WireSettings)
    chat_template: ChatTemplateMode = same_format_field("chat_template")
    chat_template_kwargs: TemplateKwargs = same_format_field("chat_template_kwargs")
    system_prompt: str | None = same_format_field("system_prompt")
    eos_tokens: list[str | int] | None = Field(
        None,
        min_length=1,
        description="Exactly the tokens that end a completion (a turn), as the vocabulary spells them "
        '("<|im_end|>", "<|eot_id|>") or as ids; both engines stop at these and no others. For a model '
        "whose generation_config.json lists several. None: generation_config.json's eos_token_id list plus "
        "the tokenizer's EOS. A string the tokenizer does not know is an error at start.",
    )
    prompts_per_batch: int = Field(
        4, ge=1, le=1024, description="Prompts pulled and generated together (each yields one group)."
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Longest prompt (chat template applied), tokens; None: the model's context "
        "(engine.max_model_len, else the model's config) less sampling.max_new_tokens, resolved by each "
        "worker and by the feeder. A value above that is an error. The feeder and the workers apply it "
        "before tokenizing (max_prompt_chars_per_token).",
    )
    max_prompt_chars_per_token: int = Field(
        32,
        ge=8,
        le=1024,
        description="A prompt over max_prompt_tokens × this many characters is over the limit without "
        "being tokenized (dropped, or cut to that many with overlong truncate), by the feeder and by the "
        "workers: a cheap bound first, so a huge prompt never reaches the tokenizer.",
        json_schema_extra={
            "why": {
                "ge": "real text averages 3-5 characters a token: lower, it would refuse prompts that fit",
                "le": "above it the bound lets prompts hundreds of times too long reach the tokenizer",
            }
        },
    )
    overlong: Literal["drop", "truncate"] = Field(
        "drop",
        description="A longer prompt: refused by the feeder and dead-lettered by a worker, with its "
        "length (drop), or cut to its last max_prompt_tokens tokens (truncate).",
    )
    weight_updates: Literal["between_batches", "in_flight"] = Field(
        "between_batches",
        description="When a worker takes a newer version: between_batches (after the batch in hand is "
        "published) or in_flight (between two decoding steps of the batch, PipelineRL's in-flight updates: "
        "tokens after the swap carry the new version; see rollout.in_flight). Not with lockstep_groups.",
    )
    in_flight: InFlightSettings = Field(
        default_factory=InFlightSettings, description="In-flight weight updates (weight_updates in_flight)."
    )
    partial: PartialSettings = Field(
        default_factory=PartialSettings, description="Partial rollouts: unfinished groups handed over."
    )
    agent: AgentSettings = Field(
        default_factory=AgentSettings, description="Multi-turn episodes with an environment (agents)."
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

    @property
    def prompt_format(self) -> PromptFormat:
        """How this worker renders prompts (`chat_template`, `chat_template_kwargs`, `system_prompt`)."""
        return PromptFormat.of(self)

    @model_validator(mode="after")
    def _in_flight_without_lockstep(self) -> RolloutSettings:
        if self.weight_updates == "in_flight" and self.lockstep_groups is not None:
            raise ValueError(
                "rollout.weight_updates in_flight does not combine with rollout.lockstep_groups: lockstep "
                "makes each version's share whole (on-policy), in-flight updates change version mid-sample"
            )
        return self

    @model_validator(mode="after")
    def _in_flight_on_vllm(self) -> RolloutSettings:
        engine = self.engine
        if self.weight_updates != "in_flight" or not isinstance(engine, VllmEngineSettings):
            return self
        if engine.in_process is False or (engine.in_process is None and engine.device == "cuda"):
            raise ValueError(
                "rollout.weight_updates in_flight with vLLM needs its engine core in the worker's process "
                "(rollout.engine.in_process true): a spawned core decodes on its own, so no token boundary "
                "for the new version is known"
            )
        if engine.max_lora_rank is not None:
            raise ValueError(
                "rollout.weight_updates in_flight does not combine with rollout.engine.max_lora_rank: a "
                "served LoRA adapter is named by each request when it begins (unset max_lora_rank: the "
                "adapter is merged into the base, which is swapped mid-batch)"
            )
        return self

    @model_validator(mode="after")
    def _buffer_inside_the_budget(self) -> RolloutSettings:
        budget, buffer = self.sampling.max_new_tokens, self.overlong_buffer.len
        if buffer is not None and buffer >= budget:
            raise ValueError(
                f"rollout.overlong_buffer.len {buffer} must be below rollout.sampling.max_new_tokens "
                f"({budget}): the penalty ramps over the last len tokens of the budget"
            )
        return self
