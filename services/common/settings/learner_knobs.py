"""The learner's optimisation knobs beyond the loss: the `learner.schedule`, `learner.kl`,
`learner.advantage` and `learner.lora` sections; re-exported by `settings.py`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sparkrl.services.common.settings.section import Section


class ScheduleSettings(Section):
    """The learning rate over the run: a linear warm-up, then constant, linear or cosine decay to
    `min_lr_ratio` × `learner.lr` at `learner.max_steps`. A live `lr` change moves the base rate."""

    kind: Literal["constant", "linear", "cosine"] = Field("constant", description="Shape after the warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warm-up from 0 (0: none).")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Where linear/cosine decay ends, × learner.lr.")


class KlSettings(Section):
    """A KL penalty to the frozen initial model (the reference), added to any loss: `coef` × the token
    mean of the estimator (Schulman's k1 = log π − log π_ref, k2 = ½(log π − log π_ref)², k3 =
    π_ref/π − log(π_ref/π) − 1). The reference is a second copy of the model on the learner."""

    coef: float = Field(0.0, ge=0, description="Weight of the KL term (0: off, no reference is loaded).")
    estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator.")


class AdvantageSettings(Section):
    """How rewards become advantages: GRPO's group normalization, its variants, and what to leave out."""

    std_normalize: bool = Field(
        True, description="Divide by the group's reward std (False: Dr. GRPO's reward − group mean)."
    )
    level: Literal["group", "batch"] = Field(
        "group", description="The std of the group, or of the whole step's rewards (mean stays per group)."
    )
    drop_equal_groups: bool = Field(
        False, description="Leave groups whose rewards are all equal (no signal) out of the step's loss."
    )


class LoraSettings(Section):
    """LoRA (services/learner/lora.py): the base frozen, a rank-`r` adapter trained on the layers
    `target_modules` names (peft's LoraConfig: `r`, `lora_alpha`, `lora_dropout`, `target_modules`); the
    workers receive the adapter alone and merge it into the base they loaded (`sync`). Needs the `lora`
    extra (peft)."""

    r: int = Field(
        0, ge=0, le=1024, description="The adapter's rank (peft's r); 0: off, every weight trained."
    )
    alpha: float = Field(
        32.0, gt=0, description="peft's lora_alpha: the adapter's output is scaled by alpha / r."
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="peft's lora_dropout on the adapter's input. Keep 0 for RL: with dropout the update's "
        "forward is not the one that recomputed π_old, and every ratio moves with the mask.",
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="peft's target_modules: names (or suffixes) of the layers to adapt, e.g. [q_proj, "
        "v_proj]; all-linear: every linear layer but the output projection.",
    )
    sync: Literal["adapter", "merged"] = Field(
        "adapter",
        description="What a version sends the workers: adapter, the adapter's tensors alone (r · (in + "
        "out) per layer instead of in · out; each worker merges them into its base, which must be the "
        "learner's: checked by checksum); merged, the whole merged model, as without LoRA.",
    )


class TrackingSettings(Section):
    """Experiment tracking of the step rows (every `metrics.jsonl` value and the lr): TensorBoard event
    files in RUN_DIR/tensorboard, Weights & Biases (offline by default: RUN_DIR/wandb, `wandb sync` it
    later), MLflow (a local file store in RUN_DIR/mlruns unless `mlflow_uri`). Needs the `tracking` extra."""

    to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="Where the step rows go besides metrics.jsonl (empty: nowhere)."
    )
    project: str = Field("sparkrl", min_length=1, description="wandb project / MLflow experiment name.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="wandb: write locally (offline) or stream to the server (online)."
    )
    mlflow_uri: str | None = Field(None, description="MLflow tracking URI; None: RUN_DIR/mlruns (files).")
