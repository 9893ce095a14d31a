"""A worker that joins late, or cannot see the learner's disk, catches up from the announcement.

Two things can come from the learner instead of a shared path: the latest weights (a snapshot file in the
worker's own run directory when it shares the learner's, else `files_url`/snapshot over HTTP, its weights
checksum verified against the signed announcement) and the model itself (when the `model` directory is
not there: `files_url`/model, each file verified, into RUN_DIR/model-from-learner).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.weight_sync.files import FetchFailed, fetch_bytes, fetch_model
from sparkrl.services.common.weight_sync.manifest import weights_checksum
from sparkrl.services.rollout.announcements import AnnouncementGate
from sparkrl.services.rollout.install import VersionInstaller

log = logging.getLogger("sparkrl.rollout")

MODEL_WAIT_LOG_S = 10.0  # how often a worker waiting for the learner's model says so


def load_snapshot(installer: VersionInstaller, path: str) -> int | None:
    """The learner's latest snapshot from a file we can read, if newer than what we hold; its bytes."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as snapshot:
        metadata = snapshot.metadata() or {}
        version = int(metadata.get("version", -1))
        if version == installer.engine.policy_version:
            return None
        tensors = {name: snapshot.get_tensor(name) for name in snapshot.keys()}
    installer.install(tensors, version, metadata.get("adapter_base"))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def fetch_snapshot(installer: VersionInstaller, announcement: WeightAnnouncement, secret: str | None) -> int:
    """The announced version's snapshot over HTTP, verified against the announcement; its bytes."""
    from safetensors.torch import load

    url = f"{announcement.files_url}/snapshot"
    tensors = load(fetch_bytes(url, secret))
    try:
        got = weights_checksum((spec.name, tensors[spec.name]) for spec in announcement.manifest)
    except KeyError as exc:
        raise FetchFailed(f"{url}: the snapshot lacks tensor {exc}") from exc
    if got != announcement.checksum:  # replaced by a newer version meanwhile, or not the learner's
        raise FetchFailed(f"{url}: checksum {got[:12]}… is not version {announcement.version}'s")
    installer.install(tensors, announcement.version, announcement.adapter_base)
    log.info("caught up to version %d over HTTP (%s)", announcement.version, url)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def catch_up(
    installer: VersionInstaller, announcement: WeightAnnouncement, gate: AnnouncementGate, secret: str | None
) -> int | None:
    """A worker outside the broadcast group loads the announced snapshot: from disk when it lies in our
    run directory's snapshots/, else over HTTP. None when there is none to load (or we hold it)."""
    if announcement.snapshot_path is None:
        return None
    local = gate.local_snapshot(announcement)
    if local is not None:
        return load_snapshot(installer, str(local))
    if announcement.files_url is None:
        return None
    return fetch_snapshot(installer, announcement, secret)


def model_dir_for(
    model: str,
    run_dir: Path,
    gate: AnnouncementGate,
    secret: str | None,
    wait_s: float,
    stop: threading.Event,
) -> str:
    """The model directory to load: `model` when it is there, else the learner's, fetched (and verified)
    into RUN_DIR/model-from-learner once the learner has announced where to get it."""
    if (Path(model) / "config.json").is_file():
        return model
    log.warning("model %s is not here: fetching the learner's once it announces its weight files", model)
    deadline, said = time.monotonic() + wait_s, time.monotonic()
    while not stop.is_set():
        announcement = gate.latest()
        if announcement is not None and announcement.files_url and announcement.model_sha256:
            try:
                dest = fetch_model(
                    announcement.files_url, announcement.model_sha256, run_dir / "model-from-learner", secret
                )
            except FetchFailed as exc:  # a learner restarting, or gone: its next announcement is retried
                log.warning("fetching the model failed (%s); trying again", exc)
            else:
                log.info("model from the learner at %s in %s", announcement.files_url, dest)
                return str(dest)
        if time.monotonic() > deadline:
            break
        if time.monotonic() - said > MODEL_WAIT_LOG_S:
            said = time.monotonic()
            log.info("still waiting for the learner's weight announcement (it serves the model)")
        stop.wait(1.0)
    raise SystemExit(
        f"model {model} does not exist and no learner announced its weight files within {wait_s:.0f}s: "
        "give the worker a model directory (`model`), or start the learner (same bus.url and sync.secret)"
    )
