"""The trainer: the model under DeepSpeed, on one rank or N — `update(batch)`, `weights()`, `save()`.

`Trainer` is all the loop sees of it. `OneRank` trains in this process; a data-parallel learner's rank 0
is `ManyRanks` (ranks.py), which orders its other ranks through whatever needs them all. So the loop has
no rank branch: one trainer or the other is built at start (`ranks.trainer_for`).

Also here: the learner's default process group (`init_distributed`), the engine (`build_engine`), and
`load` (model → engine, restored from a checkpoint when resuming), which every rank does alike.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import deepspeed
import torch
from transformers import PreTrainedTokenizerBase

from sparkrl.proto import TrajectoryGroup
from sparkrl.services.common.modeling import load_model, load_tokenizer
from sparkrl.services.common.settings import LearnerSettings
from sparkrl.services.common.settings.roles import LearnerConfig
from sparkrl.services.common.start_clock import StartClock
from sparkrl.services.learner.batch import micro_batches, samples_from_groups
from sparkrl.services.learner.checkpoint import cpu_weights, restore, save_checkpoint
from sparkrl.services.learner.fp32_head import install_fp32_head
from sparkrl.services.learner.ledger import Batch
from sparkrl.services.learner.logprobs import token_logp_and_entropy
from sparkrl.services.learner.lora import adapter_base, install_lora
from sparkrl.services.learner.reference import frozen_copy
from sparkrl.services.learner.startup import pin_build_tools
from sparkrl.services.learner.state import TrainState
from sparkrl.services.learner.stats import Updated
from sparkrl.services.learner.update import loss_is_finite, old_policy, run_updates

log = logging.getLogger("sparkrl.learner")


class Trainer(Protocol):
    """The model being trained, as the loop uses it."""

    lost: str | None  # why the learner's ranks cannot go on (a collective failed); one rank: never

    def update(self, batch: Batch, step: int, cfg: LearnerSettings) -> Updated:
        """Step `step`'s updates on `batch` (update.py) under `cfg`, the learner's settings in force (the
        live changes in them; the learning rate is set from them here, once per step): what they did. An
        update that is not finite is not applied (`Updated.not_applied`); one that raises drops its
        gradients and raises (on N ranks as `RankLost`: the run cannot go on)."""
        ...

    def lr(self) -> float | None:
        """The optimizer's learning rate: the last update's (the step rows and the status show it)."""
        ...

    def weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the version to publish (gathered under ZeRO-3): the full weights, or with LoRA's
        adapter-only sync the adapter's tensors (lora.adapter_tensors)."""
        ...

    @property
    def adapter_base(self) -> str | None:
        """With LoRA's adapter-only sync, the checksum of the base `weights()` applies to; else None."""
        ...

    def save(self, state: TrainState, tag: str | None) -> Path:
        """A checkpoint of the weights, the optimizer and `state` (checkpoint.py); `tag` names it instead
        of the step. Raises CheckpointError (on N ranks, any failure is `RankLost`)."""
        ...

    def probe(self, group: TrajectoryGroup, cfg: LearnerSettings) -> str | None:
        """The error a forward of `group` alone raises under `cfg` (what an update does first), or None."""
        ...

    def finite_alone(self, group: TrajectoryGroup, cfg: LearnerSettings) -> bool:
        """Whether `group` alone gives a finite loss under the current weights and `cfg` (nothing is
        updated)."""
        ...

    def close(self) -> None:
        """The run is over: the other ranks may exit."""
        ...


@dataclass
class OneRank:
    """A learner of one process: the engine is all there is."""

    engine: deepspeed.DeepSpeedEngine
    tokenizer: PreTrainedTokenizerBase
    cfg: LearnerSettings  # as configured, for what never changes live; the live values come with each call
    run_dir: Path
    reference: torch.nn.Module | None = None  # the frozen initial model of learner.kl (None: no KL term)
    lost: str | None = None

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def update(self, batch: Batch, step: int, cfg: LearnerSettings) -> Updated:
        try:
            return run_updates(self.engine, batch.groups, cfg, self.pad_id, step, self.reference)
        except Exception:
            self.engine.zero_grad()  # a half-accumulated gradient must not leak into the next step
            raise

    def lr(self) -> float | None:
        lrs = self.engine.get_lr()
        return float(lrs[0]) if lrs else None

    def weights(self) -> dict[str, torch.Tensor]:
        return cpu_weights(self.engine)

    @property
    def adapter_base(self) -> str | None:
        return adapter_base(self.engine.module)

    def save(self, state: TrainState, tag: str | None) -> Path:
        cfg = self.cfg
        return save_checkpoint(
            self.engine,
            self.tokenizer,
            self.run_dir,
            state,
            cfg.keep_checkpoints,
            tag,
            keep_tagged=cfg.keep_tagged_checkpoints,
        )

    @torch.no_grad()
    def probe(self, group: TrajectoryGroup, cfg: LearnerSettings) -> str | None:
        try:
            for mb in micro_batches(samples_from_groups([group]), cfg.micro_batch_tokens, self.pad_id):
                mb = mb.to(self.engine.device)
                old_policy(self.engine.module, mb, cfg)
                token_logp_and_entropy(self.engine.module, mb)
        except Exception as exc:  # whatever broke the update, for this group alone
            return f"{type(exc).__name__}: {exc}"[:1500]
        return None

    def finite_alone(self, group: TrajectoryGroup, cfg: LearnerSettings) -> bool:
        return loss_is_finite(self.engine, [group], cfg, self.pad_id, self.reference)

    def close(self) -> None:
        """One rank: no other rank waits for the stop; the engine is released with the process."""


@dataclass(frozen=True)
class Loaded:
    """What `load` makes on every rank."""

    engine: deepspeed.DeepSpeedEngine
    tokenizer: PreTrainedTokenizerBase
    state: TrainState
    resumed: bool  # restored from a checkpoint
    reference: torch.nn.Module | None  # the frozen initial model of learner.kl (None: no KL term)


def load(cfg: LearnerConfig, resume: bool, clock: StartClock | None = None) -> Loaded:
    """Model → DeepSpeed engine, restored from the latest checkpoint when resuming; `clock` marks `model`
    and `engine`."""
    clock = clock or StartClock()
    lc = cfg.learner
    torch.manual_seed(lc.seed)
    if lc.threads is not None:
        torch.set_num_threads(lc.threads)
    init_distributed(lc, cfg.sync.host)
    clock.mark("comm")  # DeepSpeed compiles its op here on a first run: a phase of its own
    tokenizer = load_tokenizer(cfg.model)
    model = learner_model(cfg.model, lc)
    # The KL reference is the initial model (cfg.model), also when resuming: copied before the checkpoint,
    # and before DeepSpeed, whose ZeRO-3 would leave a copy of the engine's module only its partitions.
    reference = frozen_copy(model) if lc.kl.coef > 0 else None
    clock.mark("model")
    engine, state = build_engine(model, lc), None
    if resume:
        rebuild = lambda: build_engine(learner_model(cfg.model, lc), lc)  # noqa: E731
        engine, state, checkpoint = restore(engine, Path(cfg.run_dir), rebuild)
        if checkpoint is None:
            log.warning("--resume: no checkpoint under %s loads; starting from %s", cfg.run_dir, cfg.model)
    clock.mark("engine")
    resumed = state is not None
    return Loaded(engine, tokenizer, state or TrainState(started_at=time.time()), resumed, reference)


def learner_model(path: str, lc: LearnerSettings) -> torch.nn.Module:
    """The model as the learner trains it: its dtype, device and attention kernel, with `learner.lora`
    its LoRA layers (lora.py), and with `learner.fp32_lm_head` its output projection in float32
    (fp32_head.py)."""
    model = load_model(path, lc.dtype, _device(lc), lc.attention)
    if lc.lora.r > 0:
        model = install_lora(model, lc.lora)
    if not lc.fp32_lm_head:
        return model
    log.info("learner.fp32_lm_head: the output projection's matmul runs in float32")
    return install_fp32_head(model)


def _device(lc: LearnerSettings) -> str:
    """The learner's device; on a GPU, each rank its own (LOCAL_RANK, as every launcher sets it)."""
    if lc.device == "cpu":
        return "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return f"cuda:{local_rank}"


def init_distributed(cfg: LearnerSettings, sync_host: str = "127.0.0.1") -> None:
    """The learner's default process group (DeepSpeed's). Under a launcher (torchrun, `deepspeed`, or
    `sparkrl up` with `learner.ranks` > 1) it is the launcher's env:// rendezvous, as many ranks as it
    started; one learner process needs no launcher: a file rendezvous (so the default group opens no
    TCP listener at all). gloo's own connections stay on loopback when the learner is local."""
    if torch.distributed.is_initialized():
        return
    pin_build_tools()  # DeepSpeed's op is built (or found built) in init_distributed
    backend = "gloo" if cfg.device == "cpu" else "nccl"
    local = os.environ.get("MASTER_ADDR", sync_host) in ("127.0.0.1", "localhost", "::1")
    if sys.platform == "linux" and local and sync_host in ("127.0.0.1", "localhost", "::1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if os.environ.get("WORLD_SIZE", "1") != "1":
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
        return
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)  # what DeepSpeed's engine reads, as a launcher would set them
    store = Path(tempfile.mkdtemp(prefix="sparkrl-dist-")) / "store"
    deepspeed.init_distributed(
        dist_backend=backend,
        auto_mpi_discovery=False,  # one process: nothing to discover
        init_method=f"file://{store}",
        rank=0,
        world_size=1,
    )


def deepspeed_config(cfg: LearnerSettings) -> dict[str, Any]:
    """Micro-batch and accumulation are driven by hand (`set_gradient_accumulation_boundary`), since an
    update's number of micro-batches depends on its token count; the config just states 1 and 1."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def build_engine(model: torch.nn.Module, cfg: LearnerSettings) -> deepspeed.DeepSpeedEngine:
    """A torch AdamW passed in, so DeepSpeed does not JIT-compile its fused Adam (~45 s on CPU)."""
    # Every update sets the lr it takes (update.set_lr, from the settings in force): this one is only what
    # the optimizer reports before the first.
    trained = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapter alone
    optimizer = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=cfg.weight_decay)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg))
    return engine
