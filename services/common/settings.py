"""The one settings tree: every service reads its own typed branch of `SparkSettings`.

Sources, lowest to highest priority: field defaults < a YAML preset (`configs/<name>.yaml` or a path) <
environment (`SPARKRL_BUS__URL=...`, `__` separates levels) < `--set key.path=value` overrides.
Variants (engine, loss) are discriminated unions, so a typo fails when the config loads, not at step 300.
"""

from __future__ import annotations

import importlib.resources
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from sparkrl.services.common.engine_settings import (
    EngineSettings,
    SamplingSettings,
    TorchEngineSettings,
    VllmEngineSettings,
)
from sparkrl.services.common.eval_settings import EvalSettings
from sparkrl.services.common.learner_knobs import (
    AdvantageSettings,
    KlSettings,
    ScheduleSettings,
    TrackingSettings,
)
from sparkrl.services.common.loss_settings import (
    ClipCovLoss,
    ClipHigherLoss,
    EightyTwentyLoss,
    EntropyBonusLoss,
    GspoLoss,
    KlCovLoss,
    LossSettings,
    LpRegLoss,
    PpoClipLoss,
)
from sparkrl.services.common.paths import resolve_model_path
from sparkrl.services.common.ray_settings import RaySettings
from sparkrl.services.common.settings_section import Section
from sparkrl.services.common.supervision_settings import SupervisionSettings, WorkerHealthSettings
from sparkrl.services.common.sync_settings import WeightSyncSettings

# The loss, sampling/engine, sync and ray sections live in their own files; they are re-exported here,
# the tree's one import point.
__all__ = [
    "AdvantageSettings",
    "ClipCovLoss",
    "ClipHigherLoss",
    "EightyTwentyLoss",
    "EntropyBonusLoss",
    "EvalSettings",
    "GspoLoss",
    "KlCovLoss",
    "KlSettings",
    "LossSettings",
    "LpRegLoss",
    "PpoClipLoss",
    "RaySettings",
    "SamplingSettings",
    "ScheduleSettings",
    "SupervisionSettings",
    "TorchEngineSettings",
    "TrackingSettings",
    "VllmEngineSettings",
    "WeightSyncSettings",
    "WorkerHealthSettings",
]


def _configs_dir() -> Path:
    """The presets: package data (so a wheel has them); a checkout installed before they were, its own."""
    try:
        return Path(str(importlib.resources.files("sparkrl.configs")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "configs"


CONFIGS_DIR = _configs_dir()


class BusSettings(Section):
    """Redis Streams that carry prompts, trajectory groups and dead letters."""

    url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL shared by every service.")
    namespace: str = Field(
        "sparkrl", min_length=1, description="Prefix of every key, so runs can share a Redis."
    )
    prompt_maxlen: int = Field(
        100_000, ge=16, description="Cap on unread prompts; the feeder waits (back-pressure) when it is full."
    )
    trajectory_maxlen: int = Field(
        512, ge=4, description="Cap on unread trajectory groups; rollout workers wait when the learner lags."
    )
    dead_letter_maxlen: int = Field(10_000, ge=16, description="Dead-letter stream length (oldest trimmed).")
    telemetry_maxlen: int = Field(
        20_000,
        ge=100,
        description="Entries kept in each telemetry stream (step rows, sync history, events, control "
        "commands); the oldest are trimmed.",
    )
    block_ms: int = Field(1000, ge=10, le=60_000, description="Longest a blocking read waits, milliseconds.")
    claim_idle_ms: int = Field(
        30_000, ge=100, description="A delivered entry idle this long is reclaimed from its (dead) consumer."
    )
    max_deliveries: int = Field(
        5, ge=1, description="An entry delivered this many times without ack goes to the dead-letter stream."
    )
    publish_timeout_s: float = Field(
        600.0, gt=0, description="How long a producer waits on a full stream before failing, seconds."
    )
    dedup_ttl_s: float = Field(
        7 * 24 * 3600.0, gt=0, description="How long a published prompt/group id is remembered, seconds."
    )
    aof_fsync: Literal["always", "everysec"] = Field(
        "always",
        description="The private Redis of `sparkrl up`: when its append-only file is fsynced. `always`: "
        "nothing acknowledged is ever lost, a killed Redis or a power loss; `everysec`: an fsync a "
        "second (Redis may hold writes back up to 2 s while the disk is slow, which a crash then loses). "
        "Measured on the demo: no difference in speed.",
    )
    socket_timeout_s: float = Field(10.0, gt=0, description="Timeout of every Redis call, seconds.")
    reconnect_max_s: float = Field(60.0, gt=0, description="Give up reconnecting after this long, seconds.")


class RewardSettings(Section):
    """The reward service (server side) and how clients reach it."""

    host: str = Field("127.0.0.1", description="Interface the service binds.")
    port: int = Field(8100, ge=0, le=65535, description="Port the service binds (0: any free port).")
    url: str = Field("http://127.0.0.1:8100", description="Base URL clients (rollout workers) call.")
    item_timeout_s: float = Field(5.0, gt=0, le=600, description="Default per-item verification time limit.")
    max_item_timeout_s: float = Field(
        30.0, gt=0, le=600, description="Cap on the per-item limit a client may ask for (`timeout_s`)."
    )
    max_request_seconds: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="Budget of one request: items not finished within it score 0 with `timeout`, so no "
        "request holds the pool longer.",
    )
    verifier_processes: int = Field(2, ge=1, le=64, description="Processes in the verification pool.")
    max_request_bytes: int = Field(16 << 20, ge=1024, description="Larger request bodies get 413.")
    custom_verifiers: list[str] = Field(
        default_factory=list,
        description="Extra verifiers as `module:function` import paths, registered under the function name.",
    )


class MetricsEndpoint(Section):
    """A service's own HTTP endpoint for `GET /metrics` (Prometheus) and `GET /healthz`."""

    host: str = Field("127.0.0.1", description="Interface it binds.")
    port: int = Field(
        0, ge=0, le=65535, description="Port it binds; 0: off (`sparkrl up` picks a free one for each)."
    )


class ControlSettings(Section):
    """The control service: REST API, live page, the fleet's Prometheus view; and how clients reach it."""

    host: str = Field("127.0.0.1", description="Interface the service binds.")
    port: int = Field(8200, ge=0, le=65535, description="Port the service binds.")
    url: str = Field("http://127.0.0.1:8200", description="Base URL clients (CLI, scripts) call.")
    token: SecretStr | None = Field(
        None,
        description="Bearer token of the mutating routes (env SPARKRL_CONTROL__TOKEN); None: read from "
        "`token_file`. The service refuses to start with neither.",
    )
    token_file: str | None = Field(
        None, description="File holding the token (`sparkrl up` writes RUN_DIR/control-token, mode 0600)."
    )
    protect_reads: bool = Field(False, description="Require the token on the read routes and the page too.")
    read_token: SecretStr | None = Field(
        None,
        description="A read-only token (env SPARKRL_CONTROL__READ_TOKEN): when set, the read routes and the "
        "page require it or the control token, so viewers can watch without the power to steer.",
    )
    command_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="How long a command waits for every target's outcome before it answers 504, seconds.",
    )
    heartbeat_s: float = Field(
        1.0, gt=0, le=60, description="How often the server-sent event stream polls Redis, seconds."
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
    health: WorkerHealthSettings = Field(
        default_factory=WorkerHealthSettings, description="A sick model is not a bad prompt."
    )
    metrics: MetricsEndpoint = Field(default_factory=MetricsEndpoint, description="/metrics and /healthz.")


class CountdownSettings(Section):
    """The countdown generator's difficulty (the defaults are the tiny model's training distribution)."""

    min_count: int = Field(2, ge=2, le=6, description="Fewest numbers in a problem.")
    max_count: int = Field(3, ge=2, le=6, description="Most numbers in a problem (≥ min_count).")
    max_number: int = Field(9, ge=1, le=1000, description="Largest number given.")
    max_target: int = Field(100, ge=1, le=100000, description="Largest target.")

    @model_validator(mode="after")
    def _counts_in_order(self) -> CountdownSettings:
        if self.min_count > self.max_count:
            raise ValueError(f"min_count {self.min_count} > max_count {self.max_count}")
        return self


class PromptSettings(Section):
    """What `sparkrl prompts` feeds into the prompt stream."""

    task: Literal["countdown", "math"] = Field(
        "countdown", description="Task; chooses generator and verifier."
    )
    path: str | None = Field(
        None, description="jsonl/parquet file of prompts (math); None: generate (countdown)."
    )
    prompt_field: str = Field("prompt", description="Column holding the question.")
    answer_field: str = Field("answer", description="Column holding the reference answer.")
    count: int | None = Field(None, ge=1, description="How many prompts to feed; None: the whole file / 64.")
    seed: int = Field(0, description="Seed of the countdown generator and of shuffling.")
    countdown: CountdownSettings = Field(
        default_factory=CountdownSettings, description="The countdown generator's difficulty."
    )
    shuffle: bool = Field(False, description="Shuffle the file's rows before feeding.")
    epochs: int = Field(
        1, ge=1, le=10_000, description="Passes over the data; when the last is trained, the run ends."
    )
    template: str = Field(
        "{prompt}",
        description="Text wrapping each question: `{prompt}` is replaced by it, every other character (a "
        "`\\boxed{}` included) is kept as written.",
    )

    @model_validator(mode="after")
    def _template_has_the_prompt(self) -> PromptSettings:
        if "{prompt}" not in self.template:
            raise ValueError(
                f"prompts.template {self.template!r} has no {{prompt}}: where does the question go?"
            )
        return self


MAX_STALENESS = 100_000  # versions; more is the same as never dropping a group


class LearnerSettings(Section):
    """The DeepSpeed learner: batches, loss, optimizer, staleness, checkpoints."""

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
    tis_cap: float | None = Field(2.0, gt=0, description="Cap of truncated IS weights; None: no correction.")
    lr: float = Field(
        1e-6,
        gt=0,
        le=0.1,
        description="Learning rate (the base of `schedule`).",
        json_schema_extra={
            "why": {
                "gt": "a step must move the weights",
                "le": "Adam moves every weight by about lr per step, whatever the gradient's scale: a larger "
                "step wrecks a pretrained policy at once (tiny models train at 1e-3, LLMs at 1e-6)",
            }
        },
    )
    schedule: ScheduleSettings = Field(default_factory=ScheduleSettings, description="lr warm-up and decay.")
    kl: KlSettings = Field(default_factory=KlSettings, description="KL penalty to the initial model.")
    advantage: AdvantageSettings = Field(
        default_factory=AdvantageSettings, description="Rewards → advantages."
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "dr_grpo"] = Field(
        "token_mean",
        description="A step's per-token losses → one: the token mean (the paper's), a mean over sequences of "
        "their sums or means, or Dr. GRPO's sum over a constant length (the rollout's max_new_tokens).",
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
    prompts_per_step: int = Field(256, ge=1, description="Groups per optimizer step.")
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
    checkpoint_every: int = Field(50, ge=1, description="Checkpoint every N steps (and on stop).")
    keep_checkpoints: int = Field(2, ge=1, description="Older checkpoints are deleted.")
    seed: int = Field(0, description="Seed of the learner's randomness (Clip-Cov's choice).")
    tracking: TrackingSettings = Field(
        default_factory=TrackingSettings, description="TensorBoard/wandb/MLflow."
    )
    samples_per_step: int = Field(
        4, ge=0, le=1000, description="Completions per step written to RUN_DIR/samples.jsonl (0: none)."
    )
    metrics: MetricsEndpoint = Field(default_factory=MetricsEndpoint, description="/metrics and /healthz.")

    @model_validator(mode="after")
    def _own_aggregation(self) -> LearnerSettings:
        if self.loss_aggregation != "token_mean" and self.loss.name in ("gspo", "eighty_twenty"):
            raise ValueError(
                f"learner.loss {self.loss.name} aggregates by its own definition: loss_aggregation token_mean"
            )
        return self

    @model_validator(mode="after")
    def _decay_needs_an_end(self) -> LearnerSettings:
        if self.schedule.kind != "constant" and self.max_steps is None:
            raise ValueError(
                f"learner.schedule.kind {self.schedule.kind} decays to learner.max_steps: set it"
            )
        return self


class SparkSettings(BaseSettings):
    """Root of the tree. Each service receives only its own branch."""

    model_config = SettingsConfigDict(
        env_prefix="SPARKRL_", env_nested_delimiter="__", extra="forbid", validate_assignment=True
    )

    model: str = Field(
        ".cache/tiny-countdown",
        description="Hugging Face model directory (config, weights, tokenizer) every service loads.",
    )
    run_dir: str = Field(
        "runs/default", description="Where logs, metrics, resolved configs and checkpoints go."
    )
    workers: int = Field(
        2,
        ge=1,
        le=1024,
        description="How many rollout workers `sparkrl up` starts (`--workers` overrides); on a small "
        "machine each one takes a core from the learner.",
    )
    bus: BusSettings = Field(default_factory=BusSettings)
    reward: RewardSettings = Field(default_factory=RewardSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    prompts: PromptSettings = Field(default_factory=PromptSettings)
    learner: LearnerSettings = Field(default_factory=LearnerSettings)
    sync: WeightSyncSettings = Field(default_factory=WeightSyncSettings)
    control: ControlSettings = Field(default_factory=ControlSettings)
    eval: EvalSettings = Field(
        default_factory=EvalSettings, description="Held-out evaluation while training."
    )
    ray: RaySettings = Field(default_factory=RaySettings, description="`sparkrl up --ray` only.")
    supervision: SupervisionSettings = Field(
        default_factory=SupervisionSettings, description="`sparkrl up` restarting what dies."
    )

    @field_validator("model")
    @classmethod
    def _model_from_the_cache(cls, model: str) -> str:
        return resolve_model_path(model)  # `.cache/tiny-countdown` from any working directory


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` → (["a", "b", "c"], value), the value parsed as YAML (so `3`, `true`, `[1, 2]` work),
    except for a text field, which takes the value as written: `prompts.template={prompt} … \\boxed{}.`
    is a sentence, not a YAML mapping."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {text!r} is not key.path=value")
    path = key.strip().split(".")
    if _is_text_field(path):
        return path, raw
    return path, yaml.safe_load(raw)


def _is_text_field(path: list[str]) -> bool:
    """Whether the field at `path` takes text (str or str | None) in every variant that has it."""
    models: list[type[BaseModel]] = [SparkSettings]
    for index, part in enumerate(path):
        fields = [model.model_fields[part] for model in models if part in model.model_fields]
        if not fields:
            return False
        types = [arg for f in fields for arg in (get_args(f.annotation) or (f.annotation,))]
        types = [arg for a in types for arg in (get_args(a) if get_origin(a) is Annotated else (a,))]
        types = [arg for a in types for arg in (get_args(a) or (a,))]  # unions of variants
        if index == len(path) - 1:
            return str in types and all(t in (str, type(None)) for t in types)
        models = [t for t in types if isinstance(t, type) and issubclass(t, BaseModel)]
    return False


DISCRIMINATORS = ("name", "kind")  # `learner.loss.name`, `rollout.engine.kind`


def _set_path(tree: dict[str, Any], path: list[str], value: Any, explicit: set[tuple[str, ...]]) -> None:
    """Set `value` at `path`. Switching a variant (`learner.loss.name: lp_reg → grpo`) drops the old
    variant's fields that came from the defaults or the preset, but keeps those the user set (`explicit`:
    environment and --set), so `rho` with `grpo` is an error in either order, never silently lost."""
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {'.'.join(path)}: {part} is not a section")
        node = child
    if path[-1] in DISCRIMINATORS and node.get(path[-1], value) != value:
        prefix = tuple(path[:-1])
        for key in list(node):
            if (*prefix, key) not in explicit:
                del node[key]
    node[path[-1]] = value
    explicit.add(tuple(path))


def _leaves(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[list[str], Any]]:
    out: list[tuple[list[str], Any]] = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out += _leaves(value, (*prefix, key))
        else:
            out.append(([*prefix, key], value))
    return out


def resolve_preset(preset: str) -> Path:
    """A preset name (`demo`) names `configs/demo.yaml`; anything else is a path."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") or path.exists():
        candidate = path
    else:
        candidate = CONFIGS_DIR / f"{preset}.yaml"
    if not candidate.is_file():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"preset {preset!r}: no file {candidate} (known presets: {', '.join(known)})")
    return candidate


def load_settings(preset: str | None = None, overrides: list[str] | None = None) -> SparkSettings:
    """Defaults < preset YAML < environment < overrides; raises pydantic's ValidationError on a bad key."""
    tree: dict[str, Any] = {}
    if preset is not None:
        tree = yaml.safe_load(resolve_preset(preset).read_text()) or {}
        if not isinstance(tree, dict):
            raise ValueError(f"preset {preset!r} is not a mapping")
    # Environment beats the preset: pydantic-settings reads it; its values are laid over the YAML tree one
    # by one, as --set's are (variants first: the env's order is not the user's).
    explicit: set[tuple[str, ...]] = set()
    from_env = _leaves(_env_tree())
    for path, value in sorted(from_env, key=lambda item: item[0][-1] not in DISCRIMINATORS):
        _set_path(tree, path, value, explicit)
    for text in overrides or []:
        path, value = parse_override(text)
        _set_path(tree, path, value, explicit)
    return SparkSettings(**tree)


def _env_tree() -> dict[str, Any]:
    """What the SPARKRL_* environment sets, as a tree of the settings' field names."""
    source = EnvSettingsSource(SparkSettings, env_prefix="SPARKRL_", env_nested_delimiter="__")
    return source()


def write_resolved(settings: SparkSettings, path: Path) -> Path:
    """Write the fully resolved tree as YAML: that file alone reproduces a service (`--config FILE`).

    Refuses a tree holding the control token: a secret belongs in a 0600 file (`control.token_file`), and
    pydantic would write it masked anyway, breaking the service that reads it back."""
    if settings.control.token is not None:
        raise ValueError("refusing to write control.token into a config file: use control.token_file")
    if settings.control.read_token is not None:
        raise ValueError(
            "control.read_token is for a control service that gets its environment (compose, Kubernetes: "
            "SPARKRL_CONTROL__READ_TOKEN); `sparkrl up` writes no secret into a config file: use "
            "control.protect_reads there (the run's token, RUN_DIR/control-token, then reads too)"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    # Owner-only: a resolved tree may hold the Redis password and the weight-sync secret.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False))
    os.chmod(path, 0o600)
    return path


def describe_settings_error(exc: Exception) -> str:
    """A settings error for people: one line per problem, `path: what is wrong (got value)`, without
    pydantic's documentation links."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return str(exc)
    lines = [f"{exc.error_count()} invalid setting{'s' if exc.error_count() != 1 else ''}:"]
    for error in exc.errors():
        path = ".".join(str(part) for part in error["loc"])
        got = error.get("input")
        shown = "" if isinstance(got, dict) or error["type"] == "missing" else f" (got {got!r})"
        hint = _did_you_mean(path) if error["type"] == "extra_forbidden" else ""
        lines.append(f"  {path}: {error['msg']}{shown}{hint}")
    return "\n".join(lines)


def _did_you_mean(path: str) -> str:
    """`; did you mean learner.lr?` for a setting that does not exist but whose name is close to one in
    the same section (the deepest section the path names, a variant's tag skipped)."""
    import difflib

    from sparkrl.services.common.settings_fields import fields

    known = {re.sub(r"\[[^\]]*\]", "", p) for p, _, _, _ in fields(SparkSettings)}
    sections = {p.rsplit(".", 1)[0] for p in known if "." in p} | {""}
    parts, leaf = path.split(".")[:-1], path.split(".")[-1]
    section = next(".".join(parts[:n]) for n in range(len(parts), -1, -1) if ".".join(parts[:n]) in sections)
    prefix = f"{section}." if section else ""
    siblings = {p[len(prefix) :].split(".")[0] for p in known if p.startswith(prefix)}
    close = difflib.get_close_matches(leaf, sorted(siblings), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]}?" if close else ""
