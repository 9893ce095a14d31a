"""Checkpoints: Hugging Face safetensors (what `from_pretrained` and vLLM load), DeepSpeed's own state
(optimizer moments, ZeRO partitions), and the trainer state (step, policy version, data counters).

Layout: RUN_DIR/checkpoints/step-000040/{hf/, deepspeed/, trainer_state.json, manifest.json} (with
LoRA also adapter/, the adapter in peft's format; hf/ holds the merged model), and
`latest`, a link to the newest whole one (checkpoint_folder.py: names, manifest, pruning, fallback). A
checkpoint is written into a hidden `.partial-*` folder and renamed into place once whole, then `latest`
is swapped: a crash or a full disk mid-save leaves the previous checkpoint as latest and no half-written
folder where a resume would look.
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

from sparkrl.services.common.weight_sync import distinct_tensors
from sparkrl.services.learner.checkpoint_folder import (
    MANIFEST,
    PARTIAL,
    STATE_FILE,
    checkpoint_root,
    clear_partials,
    folder,
    install,
    latest_checkpoint,
    not_whole,
    point_latest,
    prune,
    remove,
    resume_candidates,
    set_aside,
    space_warning,
    step_name,
    tag_folder,
    write_manifest,
)
from sparkrl.services.learner.lora import (
    adapter_base,
    adapter_tensors,
    is_lora,
    merged_state_dict,
    save_adapter,
)
from sparkrl.services.learner.state import TrainState

log = logging.getLogger("sparkrl.learner.checkpoint")

DEEPSPEED_TAG = "state"
ADAPTER_DIR = "adapter"  # with LoRA: the adapter alone, beside hf/

__all__ = ["CheckpointError", "latest_checkpoint", "load_checkpoint", "point_latest", "save_checkpoint"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message names the path, the error and the free space."""

    path: Path
    errno: int | None

    def __init__(self, path: Path, error: BaseException) -> None:
        super().__init__(describe_failure(path, error))
        self.path, self.errno = path, error.errno if isinstance(error, OSError) else None


def _free_space(path: Path) -> str:
    """Free space on the filesystem that would hold `path`, in words (its nearest existing folder's)."""
    where = path
    while not where.is_dir() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError as exc:
        return f"free space unknown ({exc.strerror})"
    unit, scale = ("GiB", 2**30) if usage.total >= 2**30 else ("MiB", 2**20)
    return f"{usage.free / scale:.1f} {unit} free of {usage.total / scale:.1f} {unit} on {where}"


def describe_failure(path: Path, error: BaseException) -> str:
    """One line: what could not be written, the errno (or the error's type), and the free space there."""
    if isinstance(error, OSError):
        code = errno.errorcode.get(error.errno, "?") if error.errno is not None else "no errno"
        what = error.strerror or str(error)
        where = f" ({error.filename})" if error.filename and str(error.filename) != str(path) else ""
    else:  # torch's writer reports a full disk as RuntimeError ("unexpected pos"), DeepSpeed its own
        code, what, where = type(error).__name__, str(error).splitlines()[0][:300] if str(error) else "", ""
    return f"checkpoint {path} could not be written: [{code}] {what}{where}; {_free_space(path)}"


def save_checkpoint(
    engine: deepspeed.DeepSpeedEngine,
    tokenizer: PreTrainedTokenizerBase,
    run_dir: Path,
    state: TrainState,
    keep: int,
    name: str | None = None,
    before_save: Callable[[Path], None] = lambda path: None,
    keep_tagged: int = 4,
) -> Path:
    """Write a whole checkpoint into a hidden folder, rename it into place, point `latest` at it, then
    prune (the newest `keep` periodic and `keep_tagged` tagged ones stay). `name` (a control command's
    tag) names the folder instead of the step. Any failure of the write (a full disk, torch's or
    DeepSpeed's error, a folder that cannot be made) removes the partial folder and raises CheckpointError;
    `latest` still names the previous whole checkpoint. `before_save(path)`: called once the partial folder
    is clear, before DeepSpeed writes (a data-parallel learner's rank 0 tells the other ranks there, which
    write their partitions with `save_partitions`)."""
    root = checkpoint_root(run_dir)
    try:
        final = folder(root, step_name(state.step)) if name is None else tag_folder(root, name)
    except ValueError as exc:  # the tag was checked on the wire already: this is the second lock
        raise CheckpointError(root / "?", exc) from exc
    tmp = folder(root, PARTIAL + final.name)
    try:
        if root.exists() and not root.is_dir():  # mkdir would say EEXIST, which names no fix
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(root))
        root.mkdir(parents=True, exist_ok=True)
        if (warning := space_warning(root)) is not None:
            log.warning("%s", warning)
        clear_partials(root)
        before_save(tmp)
        engine.save_checkpoint(str(tmp / "deepspeed"), tag=DEEPSPEED_TAG)
        save_hf_weights(engine, tokenizer, tmp / "hf")
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
        write_manifest(tmp)
        install(tmp, final)
        point_latest(root, final.name)
    except Exception as exc:
        remove(tmp)
        raise CheckpointError(final, exc) from exc
    for old in prune(root, keep, keep_tagged):
        log.info("checkpoint %s pruned", old)
    log.info("checkpoint %s (policy version %d)", final, state.policy_version)
    return final


def save_hf_weights(engine: deepspeed.DeepSpeedEngine, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """Full weights in Hugging Face format; under ZeRO-3 the partitions are gathered first. With LoRA,
    the merged model (what `from_pretrained` loads as without LoRA) and, beside it in `adapter/`, the
    adapter alone in peft's format."""
    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        if is_lora(module):
            module.save_pretrained(str(out), state_dict=merged_state_dict(module), safe_serialization=True)
            save_adapter(module, out.parent / ADAPTER_DIR, getattr(module.config, "_name_or_path", None))
        else:
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
    state_file = path / STATE_FILE
    state = json.loads(state_file.read_text())
    kept = {k: v for k, v in state.get("hparam_overrides", {}).items() if k not in names}
    if kept == state.get("hparam_overrides", {}):
        return
    tmp = state_file.with_name(f".{state_file.name}.tmp")
    tmp.write_text(json.dumps(state | {"hparam_overrides": kept}, indent=2))
    os.replace(tmp, state_file)
    if (path / MANIFEST).is_file():
        write_manifest(path)  # the state file's size changed: the manifest follows it


def load_checkpoint(engine: deepspeed.DeepSpeedEngine, path: Path) -> TrainState:
    """Restore weights, optimizer and trainer state from `path` (a checkpoint folder); raises when it is
    not whole (checkpoint_folder.not_whole) or does not load, and the engine may then hold part of it."""
    if (why := not_whole(path)) is not None:
        raise FileNotFoundError(why)
    loaded, _ = engine.load_checkpoint(str(path / "deepspeed"), tag=DEEPSPEED_TAG)
    if loaded is None:
        raise FileNotFoundError(f"no DeepSpeed state under {path / 'deepspeed'}")
    state = TrainState(**json.loads((path / STATE_FILE).read_text()))
    log.info("resumed from %s: step %d, policy version %d", path, state.step, state.policy_version)
    return state


def restore(
    engine: deepspeed.DeepSpeedEngine, run_dir: Path, rebuild: Callable[[], deepspeed.DeepSpeedEngine]
) -> tuple[deepspeed.DeepSpeedEngine, TrainState | None, Path | None]:
    """`--resume`: the engine restored from the newest checkpoint that loads — `latest`'s, else the one
    before it, and so on (checkpoint_folder.resume_candidates) — with its trainer state and folder; (a
    fresh engine, None, None) when none does. A checkpoint that fails to load is named, and set aside once
    every rank is past it; the engine is built anew after a failure (the failed load may have left part of
    its state in it). Every rank tries the same folders in the same order and they agree on each."""
    candidates, failed = resume_candidates(run_dir), []
    state, chosen = None, None
    for path in candidates:
        try:
            loaded, error = load_checkpoint(engine, path), None
        except Exception as exc:  # unpickling, a missing or truncated file, DeepSpeed's own errors
            loaded, error = None, f"{type(exc).__name__}: {str(exc)[:500]}"
        if _every_rank(error is None, engine.device):
            state, chosen = loaded, path
            break
        why = error or "another learner rank could not load it"
        log.error("checkpoint %s does not load (%s); trying the one before it", path, why)
        failed.append((path, why))
        del engine
        engine = rebuild()
    first_rank = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if first_rank:  # the others have tried these folders already (they agreed on each)
        for path, why in failed:
            log.error("checkpoint %s set aside to %s: it does not load (%s)", path, set_aside(path, why), why)
        if chosen is not None and failed:
            point_latest(checkpoint_root(run_dir), chosen.name)
    if failed and chosen is None:
        log.error("no checkpoint under %s loads: starting from the model (the journal replays what it holds)",
                  checkpoint_root(run_dir))  # fmt: skip
    return engine, state, chosen


def _every_rank(ok: bool, device: torch.device) -> bool:
    """Whether every rank of the learner's default group says `ok` (one rank: `ok`)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return ok
    flag = torch.tensor([int(ok)], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def nonfinite_tensors(weights: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity: weights never to publish."""
    return [name for name, t in weights.items() if t.is_floating_point() and not bool(t.isfinite().all())]


@torch.no_grad()
def cpu_weights(engine: deepspeed.DeepSpeedEngine) -> dict[str, torch.Tensor]:
    """A CPU copy of the version to publish (gathered under ZeRO-3); the copy lets training go on while
    the publisher thread sends it. With LoRA: the adapter alone (`learner.lora.sync: adapter`), or the
    merged model under the base's names (`merged`)."""
    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        if is_lora(module) and adapter_base(module) is not None:
            return adapter_tensors(module)
        if is_lora(module):
            return merged_state_dict(module)
        # A tied output layer is its embedding: sent once, under the embedding's name (manifest.py).
        return {n: t.detach().to("cpu", copy=True) for n, t in distinct_tensors(module.state_dict()).items()}
