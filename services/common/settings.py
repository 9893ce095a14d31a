"""The one settings tree: every service reads its own typed branch of `SparkSettings`.

Sources, lowest to highest priority: field defaults < a YAML preset (`configs/<name>.yaml` or a path) <
environment (`SPARKRL_BUS__URL=...`, `__` separates levels) < `--set key.path=value` overrides.
Variants (engine, loss) are discriminated unions, so a typo fails when the config loads, not at step 300.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BusSettings(_Section):
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
    socket_timeout_s: float = Field(10.0, gt=0, description="Timeout of every Redis call, seconds.")
    reconnect_max_s: float = Field(60.0, gt=0, description="Give up reconnecting after this long, seconds.")


class RewardSettings(_Section):
    """The reward service (server side) and how clients reach it."""

    host: str = Field("127.0.0.1", description="Interface the service binds.")
    port: int = Field(8100, ge=0, le=65535, description="Port the service binds (0: any free port).")
    url: str = Field("http://127.0.0.1:8100", description="Base URL clients (rollout workers) call.")
    item_timeout_s: float = Field(5.0, gt=0, le=600, description="Default per-item verification time limit.")
    verifier_processes: int = Field(2, ge=1, le=64, description="Processes in the verification pool.")
    max_request_bytes: int = Field(16 << 20, ge=1024, description="Larger request bodies get 413.")
    custom_verifiers: list[str] = Field(
        default_factory=list,
        description="Extra verifiers as `module:function` import paths, registered under the function name.",
    )


class SamplingSettings(_Section):
    """How a worker samples each GRPO group."""

    n: int = Field(8, ge=1, le=1024, description="Completions per prompt (the GRPO group size).")
    temperature: float = Field(
        1.0, gt=0, le=10, description="Sampling temperature; log-probs are taken at it."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1.0: off).")
    max_new_tokens: int = Field(256, ge=1, le=131_072, description="Longest completion, tokens.")
    stop: list[str] = Field(
        default_factory=list, description="Stop strings (kept out of the completion text)."
    )
    topk_logprobs: int = Field(
        20, ge=1, le=1024, description="Top-k (ids, log-probs) recorded per generated token over the vocab."
    )
    seed: int | None = Field(None, description="Sampling seed; None draws one per worker.")


class TorchEngineSettings(_Section):
    """The embedded engine: any Hugging Face causal LM, a hand-written KV-cache loop."""

    kind: Literal["torch"] = "torch"
    device: str = Field("cpu", description="torch device, e.g. `cpu` or `cuda:0`.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights' dtype.")
    max_batch_sequences: int = Field(64, ge=1, description="Most sequences decoded together in one batch.")
    threads: int | None = Field(
        None, ge=1, description="torch CPU threads of this worker; None: torch's default (all cores)."
    )


class VllmEngineSettings(_Section):
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


class RolloutSettings(_Section):
    """A rollout worker: engine, sampling, and its calls to the reward service."""

    worker_id: str | None = Field(None, description="Stable id (consumer name); None: hostname-pid.")
    engine: EngineSettings = Field(default_factory=TorchEngineSettings, description="Generation engine.")
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    prompts_per_batch: int = Field(
        4, ge=1, le=1024, description="Prompts pulled and generated together (each yields one group)."
    )
    reward_timeout_s: float = Field(60.0, gt=0, description="HTTP timeout of one scoring call, seconds.")
    reward_retries: int = Field(
        5, ge=0, le=100, description="Retries (exponential backoff) of a failed call."
    )
    heartbeat_s: float = Field(2.0, gt=0, le=60, description="Status heartbeat period, seconds.")


class PromptSettings(_Section):
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
    shuffle: bool = Field(False, description="Shuffle the file's rows before feeding.")
    template: str = Field(
        "{prompt}", description="Python format string wrapping each question; `{prompt}` is the question."
    )


class LpRegLoss(_Section):
    """Lp-Reg (arXiv 2510.03222): PPO-clip plus a pull toward the min-p proxy on the lowest-prob tokens."""

    name: Literal["lp_reg"] = "lp_reg"
    rho: float = Field(0.01, ge=0, le=1, description="Fraction of A<0 tokens considered (lowest logp first).")
    rho_pos: float = Field(0.0, ge=0, le=1, description="The same for A>0 tokens (0: off).")
    beta: float = Field(1.0, ge=0, description="Weight of the kl3 pull toward the proxy.")
    clip_low: float = Field(1.0, ge=0, le=1, description="ε_low: ratio clipped below at 1 − ε_low.")
    clip_high: float = Field(9.0, ge=0, description="ε_high: ratio clipped above at 1 + ε_high.")


class PpoClipLoss(_Section):
    """PPO/GRPO clipped surrogate."""

    name: Literal["ppo_clip", "grpo"] = "ppo_clip"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.")
    clip_high: float = Field(0.2, ge=0, description="ε_high.")


class ClipHigherLoss(_Section):
    """DAPO's Clip-Higher: asymmetric clip."""

    name: Literal["clip_higher"] = "clip_higher"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.")
    clip_high: float = Field(0.28, ge=0, description="ε_high.")


class EntropyBonusLoss(_Section):
    """GRPO + entropy loss."""

    name: Literal["entropy_bonus"] = "entropy_bonus"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.")
    clip_high: float = Field(0.2, ge=0, description="ε_high.")
    entropy_coef: float = Field(0.001, ge=0, description="Weight of −entropy in the loss.")


class EightyTwentyLoss(_Section):
    """80/20: only the highest-entropy tokens get policy gradient."""

    name: Literal["eighty_twenty"] = "eighty_twenty"
    top_frac: float = Field(
        0.2, gt=0, le=1, description="Fraction of valid tokens (highest entropy) trained."
    )
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.")
    clip_high: float = Field(0.28, ge=0, description="ε_high.")


class KlCovLoss(_Section):
    """KL-Cov: a KL penalty on the tokens of highest covariance between logp and advantage."""

    name: Literal["kl_cov"] = "kl_cov"
    kl_cov_ratio: float = Field(2e-4, ge=0, le=1, description="Fraction of tokens penalized.")
    ppo_kl_coef: float = Field(1.0, ge=0, description="Weight of |logp − old_logp| on them.")


class ClipCovLoss(_Section):
    """Clip-Cov: detach a random few tokens whose covariance lies in [lb, ub]."""

    name: Literal["clip_cov"] = "clip_cov"
    clip_low: float = Field(0.2, ge=0, le=1, description="ε_low.")
    clip_high: float = Field(0.2, ge=0, description="ε_high.")
    clip_cov_ratio: float = Field(2e-4, ge=0, le=1, description="Fraction of tokens detached.")
    clip_cov_lb: float = Field(1.0, description="Lower covariance bound.")
    clip_cov_ub: float = Field(5.0, description="Upper covariance bound.")


class GspoLoss(_Section):
    """GSPO: sequence-level importance ratio."""

    name: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0, le=1, description="ε_low on the sequence ratio.")
    clip_high: float = Field(4e-4, ge=0, description="ε_high on the sequence ratio.")


LossSettings = Annotated[
    LpRegLoss
    | PpoClipLoss
    | ClipHigherLoss
    | EntropyBonusLoss
    | EightyTwentyLoss
    | KlCovLoss
    | ClipCovLoss
    | GspoLoss,
    Field(discriminator="name"),
]


class WeightSyncSettings(_Section):
    """The learner's own process group that carries new weights to the fleet."""

    backend: Literal["gloo", "nccl"] = Field("gloo", description="gloo on CPU, nccl on GPU.")
    host: str = Field("127.0.0.1", description="Address workers reach the learner's TCPStore at.")
    port: int = Field(29600, ge=1, le=65535, description="TCPStore port the learner hosts.")
    bucket_mb: int = Field(64, ge=1, le=4096, description="Tensors travel packed in buckets of this size.")
    timeout_s: float = Field(
        60.0, gt=0, description="A member that does not join or finish within this is dropped from the group."
    )
    snapshot_every: int = Field(
        1, ge=1, description="Write the weights a late joiner loads every N policy versions."
    )


class LearnerSettings(_Section):
    """The DeepSpeed learner: batches, loss, optimizer, staleness, checkpoints, weight sync."""

    loss: LossSettings = Field(default_factory=LpRegLoss, description="Policy loss, chosen by `name`.")
    proxy_source: Literal["topk", "logits"] = Field(
        "topk", description="Lp-Reg proxy from the streamed top-k (free) or an extra π_old pass (exact)."
    )
    proxy_kappa: float = Field(0.02, gt=0, le=1, description="κ of the min-p proxy: keep p ≥ κ·max p.")
    old_logp_source: Literal["rollout", "recompute"] = Field(
        "rollout",
        description="old_logp from the rollout's log-probs, or recomputed by the learner (then truncated IS "
        "corrects rollout/learner mismatch).",
    )
    tis_cap: float | None = Field(2.0, gt=0, description="Cap of truncated IS weights; None: no correction.")
    lr: float = Field(1e-6, gt=0, description="Learning rate (constant).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Training dtype (bf16 on GPU).")
    device: str = Field("cpu", description="`cpu` or `cuda` (DeepSpeed's accelerator).")
    threads: int | None = Field(
        None,
        ge=1,
        description="torch CPU threads of the learner; None: torch's default. Several services on one "
        "small machine should split the cores: oversubscribed threads slow every one of them.",
    )
    prompts_per_step: int = Field(256, ge=1, description="Groups per optimizer step.")
    micro_batch_tokens: int = Field(8192, ge=16, description="Token budget of one forward/backward.")
    max_staleness: int = Field(
        4, ge=0, description="Groups sampled more than this many versions ago are dropped (counted)."
    )
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    checkpoint_every: int = Field(50, ge=1, description="Checkpoint every N steps (and on stop).")
    keep_checkpoints: int = Field(2, ge=1, description="Older checkpoints are deleted.")
    seed: int = Field(0, description="Seed of the learner's randomness (Clip-Cov's choice).")
    dist_port: int = Field(
        0, ge=0, le=65535, description="Port of the learner ranks' own process group (0: any free port)."
    )
    sync: WeightSyncSettings = Field(default_factory=WeightSyncSettings)


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
    bus: BusSettings = Field(default_factory=BusSettings)
    reward: RewardSettings = Field(default_factory=RewardSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    prompts: PromptSettings = Field(default_factory=PromptSettings)
    learner: LearnerSettings = Field(default_factory=LearnerSettings)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` → (["a", "b", "c"], value), the value parsed as YAML (so `3`, `true`, `[1, 2]` work)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {text!r} is not key.path=value")
    return key.strip().split("."), yaml.safe_load(raw)


DISCRIMINATORS = ("name", "kind")  # `learner.loss.name`, `rollout.engine.kind`


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {'.'.join(path)}: {part} is not a section")
        node = child
    if path[-1] in DISCRIMINATORS and node.get(path[-1], value) != value:
        # Switching variant (e.g. lp_reg → clip_higher): the old variant's fields do not apply to the new.
        node.clear()
    node[path[-1]] = value


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
    # Environment beats the preset: let pydantic-settings read it, then lay it over the YAML tree.
    from_env = SparkSettings().model_dump(exclude_unset=True)
    _deep_merge(tree, from_env)
    for text in overrides or []:
        path, value = parse_override(text)
        _set_path(tree, path, value)
    return SparkSettings(**tree)


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value


def write_resolved(settings: SparkSettings, path: Path) -> Path:
    """Write the fully resolved tree as YAML: that file alone reproduces a service (`--config FILE`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False))
    return path
