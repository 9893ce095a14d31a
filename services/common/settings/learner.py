"""The learner's settings: the `learner` section; re-exported by `settings.py`."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from sparkrl.services.common.losses import LossSettings, LpRegLoss, loss_spec
from sparkrl.services.common.settings.learner_knobs import (
    AdvantageSettings,
    KlSettings,
    LoraSettings,
    ScheduleSettings,
    TrackingSettings,
)
from sparkrl.services.common.settings.section import Section
from sparkrl.services.common.settings.servers import LearnerMetricsEndpoint

MAX_STALENESS = 100_000  # versions; more is the same as never dropping a group


class LearnerSettings(Section):
    """The DeepSpeed learner: batches, loss, optimizer, staleness, checkpoints."""

    # Frozen: a live change (hparams.apply_learner) is a new value, which the learner's loop puts in place
    # at a step boundary and hands to whatever reads it, never an assignment another holder would see.
    model_config = ConfigDict(frozen=True)

    loss: LossSettings = Field(default_factory=LpRegLoss, description="Policy loss, chosen by `name`.")
    proxy_source: Literal["topk", "logits"] = Field(
        "topk", description="Lp-Reg proxy from the streamed top-k (free) or an extra π_old pass (exact)."
    )
    proxy_kappa: float = Field(
        0.02,
        gt=0,
        le=1,
        description="κ of the min-p proxy: keep p ≥ κ·max p.",
        json_schema_extra={
            "why": {
                "gt": "κ = 0 keeps every token: no proxy",
                "le": "it is a fraction of the top probability",
            }
        },
    )
    old_logp_source: Literal["rollout", "recompute"] = Field(
        "rollout",
        description="old_logp from the rollout's log-probs, or recomputed by the learner (then truncated IS "
        "corrects rollout/learner mismatch).",
    )
    tis_cap: float | None = Field(
        2.0,
        gt=0,
        description="Cap C of truncated IS weights min(π_learner/π_rollout, C) (verl `rollout_is_threshold`, "
        "TRL `vllm_importance_sampling_cap`); None: no truncation. With old_logp_source recompute only.",
    )
    tis_level: Literal["token", "sequence"] = Field(
        "token",
        description="The ratio tis_cap truncates: each token's, or its sequence's (the product over its "
        "tokens, every token weighted alike; verl `rollout_is: token|sequence`, TRL token_truncate / "
        "sequence_truncate). sequence: not with pack_length or share_prompts (a row is one sequence).",
    )
    is_mask: Literal["none", "token", "sequence"] = Field(
        "none",
        description="Masked IS: a token (token, IcePop) or a whole sequence (sequence) whose "
        "π_learner/π_rollout leaves [is_mask_low, is_mask_high] gets weight 0, the rest keep their IS "
        "weight (the raw ratio when tis_cap is None); masked tokens still count in the token mean's "
        "divisor. verl `rollout_rs`, TRL token_mask / sequence_mask. Needs old_logp_source recompute.",
    )
    is_mask_low: float = Field(
        0.5, ge=0, le=1, description="α: the band's lower end (IcePop's 0.5; 0: no lower end)."
    )
    is_mask_high: float = Field(5.0, ge=1, le=1e6, description="β: the band's upper end (IcePop's 5).")
    lr: float = Field(
        1e-6,
        ge=1e-10,
        le=0.1,
        description="Learning rate (the base of `schedule`).",
        json_schema_extra={
            "why": {
                "ge": "Adam moves each weight by about lr per step, and a smaller step is under half the "
                "fp32 spacing of every weight above 0.002 in size: it rounds away and nothing trains",
                "le": "Adam moves every weight by about lr per step, whatever the gradient's scale: a larger "
                "step wrecks a pretrained policy at once (tiny models train at 1e-3, LLMs at 1e-6)",
            }
        },
    )
    schedule: ScheduleSettings = Field(default_factory=ScheduleSettings, description="lr warm-up and decay.")
    kl: KlSettings = Field(default_factory=KlSettings, description="KL penalty to the initial model.")
    lora: LoraSettings = Field(
        default_factory=LoraSettings, description="LoRA: train an adapter, not every weight."
    )
    advantage: AdvantageSettings = Field(
        default_factory=AdvantageSettings, description="Rewards → advantages."
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "dr_grpo"] = Field(
        "token_mean",
        description="A step's per-token losses → one: the token mean (the paper's), a mean over sequences of "
        "their sums or means, or Dr. GRPO's sum over a constant length (the rollout's max_new_tokens).",
    )
    skip_zero_advantage: bool = Field(
        True,
        description="Do not run the forward/backward of completions whose advantage is 0 (a group whose "
        "answers all scored alike) when the loss has no term on them: the same gradient, their tokens "
        "still counted in the token mean, less work (`loss/skipped_tokens`). The step's `loss/entropy` is "
        "then over the tokens trained on (see `entropy_of_skipped`). No effect with a KL to the reference or "
        "a loss that reaches A = 0 tokens (entropy bonus, 80/20, KL-Cov, Clip-Cov, GSPO).",
    )
    entropy_of_skipped: bool = Field(
        False,
        description="With `skip_zero_advantage`, also measure the entropy of the completions it leaves out, "
        "in one forward pass of them without gradient before the update, so that `loss/entropy` is over "
        "every token of the step as without skipping (comparable across losses that skip and losses that "
        "do not). Costs that forward (`time/entropy_of_skipped_s`); the gradient is unchanged.",
    )
    pack_length: int | None = Field(
        None,
        ge=2,
        description="Pack each micro-batch's completions into rows of this many positions (at least the "
        "longest's), first fit, position ids from 0 in each so attention does not cross them: fewer padded "
        "positions (`loss/padding_share`), a longer attention span per row. None: a row each, right-padded. "
        "Same gradient; token_mean aggregation only, not with GSPO (both count a row as a sequence).",
    )
    share_prompts: bool = Field(
        False,
        description="Collate each group's answers behind one copy of their prompt, a block mask keeping each "
        "answer to its prompt and itself (rows of at least `pack_length` positions): the prompt runs once "
        "per group instead of once per answer, the same logits and gradient. Pays where n · prompt ≫ "
        "answers (short answers, many samples); the mask costs L² per row, so keep rows short. eager or "
        "sdpa attention, token_mean aggregation, not GSPO.",
    )
    mask_truncated_completions: bool = Field(
        False,
        description="Leave completions that hit rollout.sampling.max_new_tokens (finish_reason length) out "
        "of the loss and its divisor (DAPO's overlong filtering; TRL's name; `loss/truncated_masked`); "
        "their group's advantages still count them. See also rollout.overlong_buffer.",
    )
    updates_per_rollout: int = Field(
        1,
        ge=1,
        le=64,
        description="Optimizer steps per learner step: the step's groups split into this many mini-batches, "
        "each its own update, π_old fixed for the whole step (the paper's off-policy setting: 8).",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage.")
    ranks: int = Field(
        1,
        ge=1,
        description="Data-parallel learner processes `sparkrl up` starts on this machine (torchrun; one "
        "per GPU on a GPU). On several nodes, start `sparkrl learner` under torchrun on each "
        "(docs/deployment.md).",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Training dtype (bf16 on GPU).")
    device: str = Field("cpu", description="`cpu` or `cuda` (DeepSpeed's accelerator).")
    gpus: list[int] = Field(
        default_factory=list,
        description="GPUs the learner may use (CUDA_VISIBLE_DEVICES); empty: no placement.",
    )
    autocast: Literal["off", "bfloat16", "auto"] = Field(
        "off",
        description="Forward/backward under torch.autocast in bf16: weights, gradients and optimizer stay "
        "float32 (on a CPU with AVX512-BF16 a quarter faster; log-probs a little noisier). `auto`: bf16 "
        "where the hardware runs it natively (oneDNN's bf16 on a CPU, a bf16-capable GPU), else off.",
    )
    fp32_lm_head: bool = Field(
        False,
        description="The output projection's matmul in float32 on a bf16 model (dtype bfloat16 or bf16 "
        "autocast), as ScaleRL's recipe (`fp32_lm_head` in NeMo-RL): logits, log-probs and the ratio with "
        "less rounding, the head's compute in float32. Off: bf16 matmul, upcast after. Its weights stay "
        "in the model's dtype.",
    )
    attention: Literal["sdpa", "eager"] | None = Field(
        None,
        description="The model's attention kernel (transformers' attn_implementation); None: its default. "
        "`eager` is faster for tiny models on a CPU, and the one bf16 autocast runs fast with there.",
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="torch CPU threads of the learner; None: torch's default. Several services on one "
        "small machine should split the cores: oversubscribed threads slow every one of them.",
    )
    startup_timeout_s: float = Field(
        900.0,
        gt=0,
        description="A start (model load, DeepSpeed's first op build) taking longer ends with an error "
        "naming what it waits on.",
    )
    prompts_per_step: int = Field(
        256, ge=1, description="Groups per optimizer step: exactly (batch: fixed), or at least (grow)."
    )
    read_ahead_mb: int = Field(
        256,
        ge=0,
        description="The trajectory stream is read, decoded and validated on a thread of its own while a "
        "step trains, up to a step's groups and this many MB of payload ahead; what it holds stays pending "
        "in Redis, as a held group does (a crash leaves it to the next learner). 0: read on the loop.",
    )
    filter_groups: Literal["none", "zero_variance"] = Field(
        "none",
        description="Dynamic sampling (DAPO; verl algorithm.filter_groups): zero_variance counts only groups "
        "whose rewards differ toward prompts_per_step, the batch filled with informative groups while the "
        "fleet keeps producing; a group whose rewards are all equal is filtered as soon as it is read: "
        "recorded (RUN_DIR/filtered_groups.jsonl), acknowledged, never trained nor made again "
        "(rollout/groups_filtered, rollout/filtered_share). Not with rollout.lockstep_groups.",
    )
    batch: Literal["fixed", "grow"] = Field(
        "fixed",
        description="fixed: every step trains exactly prompts_per_step groups (the last one of finite "
        "data fewer), so lr is tuned against one batch size; a held group that would be too stale for the "
        "next step is sent back, its prompt fed again. grow: such groups join this step instead (up to "
        "max_staleness + 1 steps' worth), so a burst of groups is trained rather than made again and steps "
        "vary in size.",
    )
    micro_batch_tokens: int = Field(8192, ge=16, description="Token budget of one forward/backward.")
    max_staleness: int = Field(
        4,
        ge=0,
        le=MAX_STALENESS,
        description="Groups sampled more than this many versions ago are not trained: their prompts are "
        "fed again and the groups made anew with newer weights (counted).",
        json_schema_extra={
            "why": {
                "ge": "a group cannot be sampled by a version newer than the learner's",
                "le": f"{MAX_STALENESS} already means 'never drop'",
            }
        },
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=1,
        le=1000,
        description="Steps in a row whose loss or gradient norm is not finite before the run stops. Such a "
        "step is never applied (its gradients are dropped, its groups go back); this many in a row means "
        "the model or a hyperparameter, not the data, went wrong.",
    )
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    min_free_mb: int = Field(
        256,
        ge=0,
        description="Free space the run directory's disk must keep, MiB: below it the run stops cleanly at "
        "the next step boundary (a final checkpoint if it fits, `ended.json` naming the fix, the reason on "
        "the status and the page), before a full disk fails the journal, Redis's append-only file and the "
        "logs mid-write. Free space, then `--resume`. 0: never.",
    )
    checkpoint_every: int = Field(50, ge=1, description="Checkpoint every N steps (and on stop).")
    keep_checkpoints: int = Field(
        2,
        ge=1,
        description="Periodic checkpoints (`step-*`) kept; older ones are deleted. Two or more let "
        "`--resume` fall back to the one before when the newest does not load, with no step lost (the "
        "journal keeps the steps since the one before the newest).",
    )
    keep_tagged_checkpoints: int = Field(
        4,
        ge=1,
        description="Tagged checkpoints (a checkpoint command's `tag`) kept, newest step first; older tagged "
        "ones are deleted (the one `latest` names never is).",
    )
    seed: int = Field(0, description="Seed of the learner's randomness (Clip-Cov's choice).")
    tracking: TrackingSettings = Field(
        default_factory=TrackingSettings, description="TensorBoard/wandb/MLflow."
    )
    samples_per_step: int = Field(
        4, ge=0, le=1000, description="Completions per step written to RUN_DIR/samples.jsonl (0: none)."
    )
    metrics: LearnerMetricsEndpoint = Field(
        default_factory=LearnerMetricsEndpoint, description="/metrics and /healthz."
    )

    @model_validator(mode="after")
    def _own_aggregation(self) -> LearnerSettings:
        if self.loss_aggregation != "token_mean" and loss_spec(self.loss.name).own_aggregation:
            raise ValueError(
                f"learner.loss {self.loss.name} aggregates by its own definition: loss_aggregation token_mean"
            )
        return self

    @model_validator(mode="after")
    def _packing_needs_token_terms(self) -> LearnerSettings:
        sequence_level = loss_spec(self.loss.name).sequence_level
        if self.share_prompts and (sequence_level or self.loss_aggregation != "token_mean"):
            raise ValueError(
                f"learner.share_prompts puts several answers in a row, which {self.loss.name} or a "
                "sequence-level aggregation counts as one sequence: use token_mean and a token-level loss, "
                "or unset share_prompts"
            )
        if self.pack_length is not None and sequence_level:
            raise ValueError(
                f"learner.pack_length: {self.loss.name} averages over each row as one sequence, which packed "
                "rows are not; unset pack_length or pick another loss"
            )
        if self.pack_length is not None and self.loss_aggregation != "token_mean":
            raise ValueError(
                f"learner.pack_length: loss_aggregation {self.loss_aggregation} counts each row as one "
                "sequence, which packed rows are not; use token_mean or unset pack_length"
            )
        return self

    @model_validator(mode="after")
    def _mismatch_needs_the_learners_old_policy(self) -> LearnerSettings:
        if self.is_mask != "none" and self.old_logp_source != "recompute":
            raise ValueError(
                f"learner.is_mask {self.is_mask} masks by π_learner/π_rollout, which only a recomputed "
                "π_old gives: set learner.old_logp_source recompute, or is_mask none"
            )
        shared_rows = self.pack_length is not None or self.share_prompts
        if "sequence" in (self.is_mask, self.tis_level) and shared_rows:
            raise ValueError(
                "learner.tis_level / is_mask sequence take each row as one sequence, which packed or shared "
                "rows are not: unset pack_length and share_prompts, or use the token level"
            )
        return self

    @model_validator(mode="after")
    def _decay_needs_an_end(self) -> LearnerSettings:
        if self.schedule.kind != "constant" and self.max_steps is None:
            raise ValueError(
                f"learner.schedule.kind {self.schedule.kind} decays to learner.max_steps: set it"
            )
        return self
