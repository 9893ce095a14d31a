"""Checkpoints: Hugging Face safetensors (what `from_pretrained` and vLLM load), DeepSpeed's own state
(optimizer moments, ZeRO partitions), and the trainer state (step, policy version, data counters).

Layout: RUN_DIR/checkpoints/step-000040/{hf/, deepspeed/, trainer_state.json}, and `latest`, a link to
the newest complete one (swapped in last, so a crash mid-save leaves the previous checkpoint as latest).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import deepspeed
import torch
from transformers import PreTrainedTokenizerBase

from sparkrl.services.learner.state import TrainState

log = logging.getLogger("sparkrl.learner.checkpoint")

DEEPSPEED_TAG = "state"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message names the path, the errno and the free space."""

    path: Path
    errno: int | None

    def __init__(self, path: Path, error: OSError) -> None:
        super().__init__(describe_failure(path, error))
        self.path, self.errno = path, error.errno


def _free_space(path: Path) -> str:
    """Free space on the filesystem that would hold `path`, in words (its nearest existing folder's)."""
    where = path
    while not where.is_dir() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError as exc:
        return f"free space unknown ({exc.strerror})"
    return f"{usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB on {where}"


def describe_failure(path: Path, error: OSError) -> str:
    """One line: what could not be written, the errno, and the free space there."""
    code = errno.errorcode.get(error.errno, "?") if error.errno is not None else "no errno"
    what = error.strerror or str(error)
    where = f" ({error.filename})" if error.filename and str(error.filename) != str(path) else ""
    return f"checkpoint {path} could not be written: [{code}] {what}{where}; {_free_space(path)}"


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(
    engine: deepspeed.DeepSpeedEngine,
    tokenizer: PreTrainedTokenizerBase,
    run_dir: Path,
    state: TrainState,
    keep: int,
    name: str | None = None,
    before_save: Callable[[Path], None] = lambda path: None,
) -> Path:
    """Write a complete checkpoint, then point `latest` at it, then prune the oldest `step-*` beyond
    `keep`. `name` (a control command's tag) names the folder instead of the step; those are kept.
    `before_save(path)`: called once the folder is clear, before DeepSpeed writes (a data-parallel
    learner's rank 0 tells the other ranks there, which write their partitions with `save_partitions`)."""
    root = checkpoint_root(run_dir)
    path = root / (name or f"step-{state.step:06d}")
    try:
        if path.exists():
            shutil.rmtree(path)
        before_save(path)
        engine.save_checkpoint(str(path / "deepspeed"), tag=DEEPSPEED_TAG)
        save_hf_weights(engine, tokenizer, path / "hf")
        (path / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2))
        point_latest(root, path.name)
    except OSError as exc:
        # `latest` still names the previous complete checkpoint; this half-written one must not linger.
        shutil.rmtree(path, ignore_errors=True)
        raise CheckpointError(path, exc) from exc
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint %s (policy version %d)", path, state.policy_version)
    return path


def save_hf_weights(engine: deepspeed.DeepSpeedEngine, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """Full weights in Hugging Face format; under ZeRO-3 the partitions are gathered first."""
    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        module.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def save_partitions(engine: deepspeed.DeepSpeedEngine, path: Path) -> None:
    """A rank but the first's part of `save_checkpoint`: the same collectives (DeepSpeed's save, the
    ZeRO-3 gather of the Hugging Face weights), writing only this rank's partitions."""
    engine.save_checkpoint(str(path / "deepspeed"), tag=DEEPSPEED_TAG)
    join_gather(engine)


def join_gather(engine: deepspeed.DeepSpeedEngine) -> None:
    """Take part in the gather of rank 0's `cpu_weights` / `save_hf_weights` (a collective under ZeRO-3,
    nothing below it); this rank keeps nothing of it."""
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        log.debug("ZeRO-3 weights gathered for rank 0")


def drop_overrides(path: Path, names: list[str]) -> None:
    """Take live changes out of a written checkpoint's trainer state, so a resume does not re-apply them
    (replaced whole: a crash leaves the old file or the new one)."""
    state_file = path / "trainer_state.json"
    state = json.loads(state_file.read_text())
    kept = {k: v for k, v in state.get("hparam_overrides", {}).items() if k not in names}
    if kept == state.get("hparam_overrides", {}):
        return
    tmp = state_file.with_name(f".{state_file.name}.tmp")
    tmp.write_text(json.dumps(state | {"hparam_overrides": kept}, indent=2))
    os.replace(tmp, state_file)


def point_latest(root: Path, name: str) -> None:
    """`root/latest` → `name`, a relative symlink swapped in by rename: it is always a whole checkpoint
    directory, so `from_pretrained(".../checkpoints/latest/hf")` loads the newest model."""
    tmp = root / ".latest.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(name, target_is_directory=True)
    os.replace(tmp, root / "latest")


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint: `latest`'s target (a text file naming it, in runs from before
    `latest` became a link)."""
    root = checkpoint_root(run_dir)
    marker = root / "latest"
    if marker.is_symlink():
        path = root / os.readlink(marker)
    elif marker.is_file():
        path = root / marker.read_text().strip()
    else:
        return None
    return path if (path / "trainer_state.json").is_file() else None


def load_checkpoint(engine: deepspeed.DeepSpeedEngine, path: Path) -> TrainState:
    """Restore weights, optimizer and trainer state from `path` (a `step-*` folder)."""
    loaded, _ = engine.load_checkpoint(str(path / "deepspeed"), tag=DEEPSPEED_TAG)
    if loaded is None:
        raise FileNotFoundError(f"no DeepSpeed state under {path / 'deepspeed'}")
    state = TrainState(**json.loads((path / "trainer_state.json").read_text()))
    log.info("resumed from %s: step %d, policy version %d", path, state.step, state.policy_version)
    return state


def nonfinite_tensors(weights: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity: weights never to publish."""
    return [name for name, t in weights.items() if t.is_floating_point() and not bool(t.isfinite().all())]


@torch.no_grad()
def cpu_weights(engine: deepspeed.DeepSpeedEngine) -> dict[str, torch.Tensor]:
    """A CPU copy of the full weights to publish (gathered under ZeRO-3); the copy lets training go on
    while the publisher thread sends it."""
    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        return {name: t.detach().to("cpu", copy=True) for name, t in module.state_dict().items()}
