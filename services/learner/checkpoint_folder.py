"""The checkpoints folder, `RUN_DIR/checkpoints/`, as files: which names may be made there, the manifest
that says a checkpoint is whole, `latest`, which checkpoints a resume may start from, what is pruned and
what is set aside. No DeepSpeed here (checkpoint.py writes and loads the state).

    checkpoints/
      step-000040/              a periodic checkpoint (the step, six digits)
      before-lr-change/         a tagged one (a control command's `tag`)
      latest -> step-000040     a relative link to the newest whole one, swapped in by rename
      .partial-step-000042/     a checkpoint being written (renamed into place once whole)
      set-aside/step-000038-…   a checkpoint that failed to load, moved out of the resume's way

Every folder name written or removed here is made by `folder()`: one safe component (proto/names.py)
whose path resolves directly inside `checkpoints/`, so no input (a tag from the control API, a link
planted in the folder) can make the learner write or delete anything outside it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from sparkrl.proto.names import checkpoint_tag, safe_name

log = logging.getLogger("sparkrl.learner.checkpoint")

MANIFEST = "manifest.json"  # written last: every file of the checkpoint with its size
STATE_FILE = "trainer_state.json"
LATEST = "latest"
PARTIAL = ".partial-"  # a checkpoint being written; hidden, so no tag can name it (tags start alphanumeric)
REPLACED = ".replaced-"  # an older folder of the same name, removed once the new one is in place
SET_ASIDE = "set-aside"
STEP_NAME = re.compile(r"^step-(\d{6,})$")


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def folder(root: Path, name: str) -> Path:
    """`root / name`, once `name` is one safe component (a made `.partial-`/`.replaced-` name, or a plain
    name) and the path resolves directly inside `root` (a link planted there that points elsewhere is
    refused). ValueError otherwise: nothing is written or removed."""
    for prefix in (PARTIAL, REPLACED):
        if name.startswith(prefix):
            safe_name(name[len(prefix) :])
            break
    else:
        safe_name(name)
    path = root / name
    if path.resolve().parent != root.resolve():
        raise ValueError(f"{path} resolves to {path.resolve()}, outside {root}: refused")
    return path


def tag_folder(root: Path, tag: str) -> Path:
    """The folder of a tagged checkpoint: a tag that is not a name the learner makes itself."""
    return folder(root, checkpoint_tag(tag))


def write_manifest(path: Path) -> None:
    """Every file under `path` (but the manifest) with its size, written last, fsynced: a checkpoint
    whose manifest is there and whose files match it was written whole."""
    files = {
        str(f.relative_to(path)): f.stat().st_size
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name != MANIFEST
    }
    data = json.dumps({"files": files, "written_at": time.time()}, indent=1)
    with (path / MANIFEST).open("w") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def not_whole(path: Path) -> str | None:
    """Why `path` is not a whole checkpoint (a file missing, of another size, no trainer state), or None.
    A checkpoint from before manifests were written counts as whole when it has its trainer state."""
    if not (path / STATE_FILE).is_file():
        return f"{path} has no {STATE_FILE}"
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError) as exc:
        return f"{manifest} cannot be read: {exc}"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} holds {file.stat().st_size} bytes, not the {size} written"
    return None


def size_of(path: Path) -> int:
    """Bytes of the files under `path`."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def point_latest(root: Path, name: str) -> None:
    """`root/latest` → `name`, a relative symlink swapped in by rename: it is always a whole checkpoint
    directory, so `from_pretrained(".../checkpoints/latest/hf")` loads the newest model."""
    folder(root, name)
    tmp = root / ".latest.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(name, target_is_directory=True)
    os.replace(tmp, root / LATEST)


def latest_target(root: Path) -> Path | None:
    """Where `latest` points (a text file naming it, in runs from before it became a link), inside root."""
    marker = root / LATEST
    if marker.is_symlink():
        name = os.readlink(marker)
    elif marker.is_file():
        name = marker.read_text().strip()
    else:
        return None
    try:
        return folder(root, name)
    except ValueError as exc:
        log.error("checkpoints/latest is not followed: %s", exc)
        return None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest whole checkpoint `latest` names; None without one."""
    path = latest_target(checkpoint_root(run_dir))
    return path if path is not None and (path / STATE_FILE).is_file() else None


@dataclass(frozen=True)
class Held:
    """A checkpoint folder in `checkpoints/`: its path and the step its trainer state records."""

    path: Path
    step: int

    @property
    def tagged(self) -> bool:
        return STEP_NAME.match(self.path.name) is None


def held(root: Path) -> list[Held]:
    """The checkpoint folders (periodic and tagged, with a readable trainer state), oldest step first;
    never `latest`, a partial write or what was set aside."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.name.startswith(".") or path.name in (LATEST, SET_ASIDE) or path.is_symlink():
            continue
        try:
            step = int(json.loads((path / STATE_FILE).read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found.append(Held(path, step))
    return sorted(found, key=lambda h: (h.step, h.path.stat().st_mtime))


def resume_candidates(run_dir: Path) -> list[Path]:
    """What `--resume` tries, in order: `latest`'s target, then every other checkpoint, newest step first
    (a fallback when one does not load)."""
    root = checkpoint_root(run_dir)
    first = latest_target(root)
    others = [h.path for h in reversed(held(root)) if h.path != first]
    return ([first] if first is not None and first.is_dir() else []) + others


def set_aside(path: Path, why: str) -> Path:
    """Move a checkpoint that failed to load to `checkpoints/set-aside/NAME-<time>` with a note of why,
    so the next resume does not try it again; returns where it went."""
    root = path.parent
    aside_root = root / SET_ASIDE
    aside_root.mkdir(exist_ok=True)
    target = aside_root / f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    os.replace(folder(root, path.name), target)
    (target / "SET_ASIDE.txt").write_text(f"set aside by the learner at resume: {why}\n")
    return target


def install(tmp: Path, final: Path) -> None:
    """Rename the whole checkpoint `tmp` into place as `final`; an older folder of that name is renamed
    away first and removed after (a crash between the two leaves it hidden, never half of each)."""
    root = final.parent
    old = None
    if final.exists() or final.is_symlink():
        old = folder(root, REPLACED + final.name)
        remove(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    if old is not None:
        remove(old)


def remove(path: Path) -> None:
    """Delete a checkpoint folder of `checkpoints/` (named by `folder`), never what a link points to."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def clear_partials(root: Path) -> None:
    """Remove what an interrupted write left (`.partial-*`, `.replaced-*`)."""
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.name.startswith((PARTIAL, REPLACED)):
            if path.is_symlink():  # planted: removed as a link, never followed
                path.unlink()
            else:
                remove(folder(root, path.name))


def prune(root: Path, keep: int, keep_tagged: int) -> list[Path]:
    """The newest `keep` periodic checkpoints and `keep_tagged` tagged ones stay (by step), and whatever
    `latest` names; the rest are deleted. Returns what was."""
    latest = latest_target(root)
    checkpoints = held(root)
    periodic = [h.path for h in checkpoints if not h.tagged]
    tagged = [h.path for h in checkpoints if h.tagged]
    doomed = periodic[: max(len(periodic) - keep, 0)] + tagged[: max(len(tagged) - keep_tagged, 0)]
    removed = []
    for path in doomed:
        if path == latest:
            continue
        remove(folder(root, path.name))
        removed.append(path)
    return removed


def space_warning(root: Path) -> str | None:
    """A warning when the disk under `root` has less room than the newest checkpoint took (the next one
    will likely fail), naming what to do; None when it has room (or nothing was written yet)."""
    newest = latest_checkpoint(root.parent)
    if newest is None:
        return None
    needed = size_of(newest)
    free = shutil.disk_usage(root).free
    if free >= needed:
        return None
    return (
        f"{root} has {free / 2**20:.1f} MiB free and the last checkpoint took {needed / 2**20:.1f} MiB: the "
        "next one will likely fail (training goes on; the journal keeps the steps). Free space, or lower "
        "learner.keep_checkpoints / learner.keep_tagged_checkpoints"
    )


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
