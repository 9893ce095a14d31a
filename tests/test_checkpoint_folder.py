"""The checkpoints folder as files (services/learner/checkpoint_folder.py) and the learner's save and
resume over it with real DeepSpeed: names are made, never taken (every traversal form refused before
anything is written or removed); a write is atomic (a full disk — a real tmpfs — leaves no partial folder
and `latest` on the previous one); a resume falls back past a checkpoint that does not load; retention of
periodic and tagged checkpoints."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from _tmpfs import tmpfs

from sparkrl.proto import CheckpointCommand
from sparkrl.proto.views import CheckpointRequest
from sparkrl.services.common.modeling import load_model, load_tokenizer
from sparkrl.services.common.settings import load_settings
from sparkrl.services.learner.checkpoint import CheckpointError, restore, save_checkpoint
from sparkrl.services.learner.checkpoint_folder import (
    folder,
    held,
    latest_checkpoint,
    not_whole,
    point_latest,
    prune,
    resume_candidates,
    write_manifest,
)
from sparkrl.services.learner.state import TrainState
from sparkrl.services.learner.trainer import build_engine, init_distributed

# Every form of "a name that is a path" we could think of; each must be refused on the wire and here.
TRAVERSALS = [
    ".",
    "..",
    "../x",
    "..\\x",
    "a/b",
    "a\\b",
    "/etc",
    "/",
    "./x",
    "x/..",
    "x/.",
    ".hidden",
    "...",
    "~",
    "~root",
    "-rf",
    "",
    " ",
    "x ",
    "x\x00y",
    "x\ny",
    "%2e%2e",
    "%2F",
    "\u2024\u2024",  # one-dot leaders that look like '..'
    "\uff0e\uff0e",  # fullwidth dots
    "ｘ",
    "latest",
    "LATEST",
    "step-000001",
    "step-999999",
    "Step-1",
    "a" * 129,
]


@pytest.mark.parametrize("tag", TRAVERSALS, ids=range(len(TRAVERSALS)))
def test_every_traversal_form_is_refused_on_the_wire(tag: str) -> None:
    with pytest.raises(ValueError):
        CheckpointRequest(tag=tag)
    with pytest.raises(ValueError):
        CheckpointCommand(command="checkpoint", tag=tag)


def test_plain_tags_pass() -> None:
    for tag in ("before-lr-change", "v1.2", "a", "A_b-c.d", "stepper", "latest2", "9" * 128):
        assert CheckpointRequest(tag=tag).tag == tag


def test_folder_refuses_names_and_links_that_leave_the_folder(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir()
    made = ("latest", "LATEST", "Step-1", "step-000001", "step-999999")  # names, but the learner's own
    for name in [t for t in TRAVERSALS if t not in made] + ["step-000001/../.."]:
        with pytest.raises(ValueError):
            folder(root, name)
    (root / "escape").symlink_to(tmp_path, target_is_directory=True)  # planted: points outside
    with pytest.raises(ValueError, match="outside"):
        folder(root, "escape")
    assert folder(root, "step-000001") == root / "step-000001"


def fake_checkpoint(root: Path, name: str, step: int, payload: bytes = b"weights") -> Path:
    path = root / name
    (path / "deepspeed").mkdir(parents=True)
    (path / "deepspeed" / "model.pt").write_bytes(payload)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    write_manifest(path)
    return path


def test_manifest_names_a_truncated_or_missing_file(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, "step-000002", 2, b"x" * 100)
    assert not_whole(path) is None
    (path / "deepspeed" / "model.pt").write_bytes(b"x" * 10)
    assert "holds 10 bytes, not the 100 written" in (not_whole(path) or "")
    (path / "deepspeed" / "model.pt").unlink()
    assert "is missing" in (not_whole(path) or "")
    (path / "trainer_state.json").unlink()
    assert "has no trainer_state.json" in (not_whole(path) or "")


def test_prune_keeps_newest_of_each_kind_and_what_latest_names(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        fake_checkpoint(root, f"step-{step:06d}", step)
    for step, tag in ((1, "first"), (3, "mid"), (5, "late")):
        fake_checkpoint(root, tag, step)
    point_latest(root, "first")  # a resume pointed latest back at an old one
    removed = prune(root, keep=2, keep_tagged=1)
    assert sorted(p.name for p in removed) == ["mid", "step-000002"]
    assert sorted(h.path.name for h in held(root)) == ["first", "late", "step-000004", "step-000006"]


def test_resume_candidates_start_at_latest_then_newest_first(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        fake_checkpoint(root, f"step-{step:06d}", step)
    fake_checkpoint(root, "tagged", 3)
    (root / ".partial-step-000006").mkdir()
    (root / "set-aside").mkdir()
    point_latest(root, "step-000004")
    names = [p.name for p in resume_candidates(tmp_path)]
    assert names == ["step-000004", "tagged", "step-000002"]


# --- with real DeepSpeed -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_and_tokenizer(tiny_model_dir: Path) -> tuple[object, object]:  # noqa: F811
    cfg = load_settings("smoke").learner
    init_distributed(cfg)
    return build_engine(load_model(tiny_model_dir), cfg), load_tokenizer(tiny_model_dir)


def checksums(root: Path) -> dict[str, tuple[int, float]]:
    """Every file and link under `root`: (size, mtime) — what a refused request must leave unchanged."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            stat = path.lstat()
            out[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime)
    return out


def test_the_learner_refuses_a_tag_that_is_a_path_and_touches_nothing(
    engine_and_tokenizer: tuple, tmp_path: Path
) -> None:
    engine, tokenizer = engine_and_tokenizer
    run = tmp_path / "run"
    save_checkpoint(engine, tokenizer, run, TrainState(step=1), keep=2)
    (run / "metrics.jsonl").write_text("{}\n")
    before = checksums(tmp_path)
    for tag in TRAVERSALS:
        with pytest.raises(CheckpointError):
            save_checkpoint(engine, tokenizer, run, TrainState(step=2), keep=2, name=tag)
    assert checksums(tmp_path) == before


def test_a_tag_reused_replaces_its_folder_whole(engine_and_tokenizer: tuple, tmp_path: Path) -> None:
    engine, tokenizer = engine_and_tokenizer
    first = save_checkpoint(engine, tokenizer, tmp_path, TrainState(step=1), keep=2, name="mine")
    again = save_checkpoint(engine, tokenizer, tmp_path, TrainState(step=2), keep=2, name="mine")
    assert first == again and json.loads((again / "trainer_state.json").read_text())["step"] == 2
    assert not_whole(again) is None and latest_checkpoint(tmp_path) == again
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")] == []


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs of 4 MiB (one tiny-model checkpoint fits, two do not); root only."""
    with tmpfs(tmp_path / "disk", "4m") as where:
        yield where


def test_a_full_disk_fails_the_write_whole_and_leaves_latest(
    engine_and_tokenizer: tuple, small_disk: Path
) -> None:
    engine, tokenizer = engine_and_tokenizer
    first = save_checkpoint(engine, tokenizer, small_disk, TrainState(step=1), keep=2)
    with pytest.raises(CheckpointError) as failed:
        save_checkpoint(engine, tokenizer, small_disk, TrainState(step=2), keep=2)
    assert "could not be written" in str(failed.value) and "MiB free of 4.0 MiB" in str(failed.value)
    root = small_disk / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]  # no partial folder
    assert latest_checkpoint(small_disk) == first and not_whole(first) is None


def corrupt(path: Path) -> None:
    """Overwrite every DeepSpeed state file of a checkpoint with garbage of the same size (the manifest
    still matches: only loading it can tell)."""
    for file in (path / "deepspeed").rglob("*.pt"):
        file.write_bytes(b"garbage!" + b"\x00" * (file.stat().st_size - 8))


def test_resume_falls_back_past_a_checkpoint_that_does_not_load(
    engine_and_tokenizer: tuple,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    engine, tokenizer = engine_and_tokenizer
    cfg = load_settings("smoke").learner
    with torch.no_grad():
        next(engine.module.parameters()).add_(0.5)  # step 1's weights differ from the model's
    save_checkpoint(engine, tokenizer, tmp_path, TrainState(step=1, policy_version=1), keep=3)
    saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with torch.no_grad():
        next(engine.module.parameters()).add_(0.5)
    newest = save_checkpoint(engine, tokenizer, tmp_path, TrainState(step=2, policy_version=2), keep=3)
    corrupt(newest)

    fresh = build_engine(load_model(tiny_model_dir), cfg)
    rebuilt = []

    def rebuild() -> object:
        rebuilt.append(1)
        return build_engine(load_model(tiny_model_dir), cfg)

    restored, state, chosen = restore(fresh, tmp_path, rebuild)
    assert state is not None and state.step == 1 and chosen == tmp_path / "checkpoints" / "step-000001"
    assert rebuilt == [1]  # the engine the failed load touched was replaced
    for name, tensor in restored.module.state_dict().items():
        torch.testing.assert_close(tensor, saved[name])
    assert latest_checkpoint(tmp_path) == chosen
    aside = list((tmp_path / "checkpoints" / "set-aside").iterdir())
    assert len(aside) == 1 and aside[0].name.startswith("step-000002-")
    assert "UnpicklingError" in (aside[0] / "SET_ASIDE.txt").read_text()
