"""No input names a path, beyond the checkpoint tag (tests/test_checkpoint_folder.py): every other name
from outside the process that meets the file system, tried with every traversal form and a planted link.

- the learner's weight-file server (real HTTP) serves only the plain names it listed, and lists only those;
- a worker fetching the model writes a listed name only as one plain component inside its folder: a
  forged listing (real HTTP) or a link planted there is refused with FetchFailed, nothing written outside;
- a weight announcement (signed, through a private redis-server) is loaded from disk only when its
  `snapshot_path` resolves inside the worker's run directory's `snapshots/`;
- `sparkrl eval RUN_DIR` follows `checkpoints/latest` only to a checkpoint inside `checkpoints/`;
- the control service's `/static/` never serves a file outside its folder (raw HTTP, paths unnormalized).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint_folder import TRAVERSALS
from test_control_api import Server

from sparkrl.evaluate import resolve_model
from sparkrl.proto import WeightAnnouncement, sign_announcement
from sparkrl.proto.names import SAFE_NAME
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import BusSettings, ControlSettings
from sparkrl.services.common.weight_sync import WeightSender
from sparkrl.services.common.weight_sync.files import (
    FetchFailed,
    WeightFileServer,
    fetch_model,
    files_token,
    listing_sha256,
)
from sparkrl.services.control.app import create_app
from sparkrl.services.learner.publisher import write_snapshot
from sparkrl.services.rollout.announcements import ANNOUNCEMENT_KEY, AnnouncementGate
from sparkrl.services.rollout.catch_up import catch_up
from sparkrl.services.rollout.install import VersionInstaller

SECRET = "names-as-paths-secret-0123456789abcdef"
# The forms a file name from the wire could take that are not one plain name (the checkpoint list's
# reserved names, `latest` and `step-*`, are plain file names here).
NOT_NAMES = [t for t in TRAVERSALS if SAFE_NAME.fullmatch(t) is None]


def tree(root: Path, skip: Path | None = None) -> dict[str, str]:
    """Every entry under `root` (but `skip`): a file's sha256, a link's target, a folder as such."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if skip is not None and path.is_relative_to(skip):
                continue
            if path.is_symlink():
                out[str(path)] = "-> " + os.readlink(path)
            elif path.is_file():
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                out[str(path)] = "dir"
    return out


def raw_get(port: int, target: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """GET `target` exactly as written (a client library would normalize `..` away); (status, answer)."""
    lines = [f"GET {target} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = b""
        while data := sock.recv(65536):
            answer += data
    return int(answer.split(b" ", 2)[1]), answer


# ── the learner's weight-file server ──────────────────────────────────────────────────────────────────


@pytest.fixture
def served(tmp_path: Path) -> Iterator[WeightFileServer]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "test"}')
    (model / "odd name.json").write_text("a name no worker writes")
    (model / ".hidden").write_text("hidden")
    (model / "sub").mkdir()
    (model / "sub" / "inner.json").write_text("one level only")
    (tmp_path / "secret.txt").write_text("outside the model directory")
    snapshot = write_snapshot({"w": torch.arange(3.0)}, 1, tmp_path / "snapshots")
    files = WeightFileServer("127.0.0.1", 0, model, snapshot, SECRET)
    files.start()
    assert files.wait_listed(30)
    yield files
    files.close()


def test_the_weight_file_server_lists_and_serves_plain_names_only(served: WeightFileServer) -> None:
    assert served.listing is not None and sorted(served.listing) == ["config.json"]
    auth = {"Authorization": f"Bearer {files_token(SECRET)}"}
    assert served.port is not None
    status, answer = raw_get(served.port, "/model/config.json", auth)
    assert status == 200 and answer.endswith(b'{"model_type": "test"}')
    for target in [
        "/model/..",
        "/model/.",
        "/model/../secret.txt",
        "/model/..%2Fsecret.txt",
        "/model/%2e%2e/secret.txt",
        "/model/sub/inner.json",
        "/model/sub",
        "/model//etc/passwd",
        "/model/.hidden",
        "/model/odd%20name.json",
        "/model/config.json/..",
        "/model/./config.json",
    ]:
        status, answer = raw_get(served.port, target, auth)
        assert status == 404, (target, answer[:300])
        assert b"outside the model" not in answer and b"root:" not in answer


# ── a worker fetching the model from a listing ────────────────────────────────────────────────────────


class ForgedFiles:
    """A weight-file server (real HTTP) whose listing says what the test wants: what a forged announcement
    could point a worker to when `sync.secret` is not set (or what a compromised learner could list)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.listing = {
            name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for name, data in files.items()
        }
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/model":
                    body = json.dumps({"files": outer.listing}).encode()
                else:  # an unknown name gets the first file: the worker checks the digest
                    first = next(iter(outer.files.values()))
                    body = outer.files.get(self.path.removeprefix("/model/"), first)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fetch(self, dest: Path) -> Path:
        return fetch_model(self.url, listing_sha256(self.listing), dest, None)


@pytest.mark.parametrize("name", NOT_NAMES, ids=range(len(NOT_NAMES)))
def test_a_listed_name_that_is_a_path_is_refused_and_nothing_is_written(name: str, tmp_path: Path) -> None:
    work = tmp_path / "run"
    (work / "a").mkdir(parents=True)
    (work / "keep.txt").write_text("the run's own file")
    before = tree(tmp_path)
    dest = work / "model-from-learner"
    forged = ForgedFiles({"config.json": b"{}", name: b"attacker bytes"})  # a good name first
    try:
        with pytest.raises(FetchFailed, match="unsafe file name"):
            forged.fetch(dest)
    finally:
        forged.close()
    assert list(dest.iterdir()) == []  # not even the good file: every name is checked first
    assert tree(tmp_path, skip=dest) == before


def test_a_link_planted_in_the_model_folder_is_refused_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("not the worker's to overwrite")
    dest = tmp_path / "run" / "model-from-learner"
    dest.mkdir(parents=True)
    (dest / "config.json").symlink_to(outside / "config.json")
    (dest / "tokenizer.json").symlink_to(outside)  # a link to a folder
    before = tree(tmp_path)
    for name in ("config.json", "tokenizer.json"):
        forged = ForgedFiles({name: b"new bytes"})
        try:
            with pytest.raises(FetchFailed, match="outside"):
                forged.fetch(dest)
        finally:
            forged.close()
    assert tree(tmp_path) == before


def test_a_plain_listing_is_fetched(tmp_path: Path) -> None:
    forged = ForgedFiles({"config.json": b'{"a": 1}'})
    try:
        dest = forged.fetch(tmp_path / "model-from-learner")
    finally:
        forged.close()
    assert (dest / "config.json").read_bytes() == b'{"a": 1}'


# ── a weight announcement's snapshot_path ─────────────────────────────────────────────────────────────


class NoEngine:
    """What catch_up must not load into: any call fails the test."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the engine was asked for {name}: an announced snapshot was loaded")


def test_an_announced_snapshot_is_loaded_only_from_inside_our_snapshots(
    bus_settings: BusSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    ours = write_snapshot({"w": torch.arange(3.0)}, 2, run_dir / "snapshots")
    theirs = write_snapshot({"w": torch.arange(3.0)}, 2, elsewhere)
    (run_dir / "snapshots" / "link.safetensors").symlink_to(theirs)
    (run_dir / "snapshots" / "up").symlink_to(elsewhere, target_is_directory=True)
    monkeypatch.chdir(run_dir / "snapshots")  # where a relative path resolves from
    paths = [
        str(run_dir / "snapshots" / ".." / ".." / "elsewhere" / theirs.name),
        str(theirs),  # an absolute path elsewhere
        f"../../elsewhere/{theirs.name}",  # relative, from inside snapshots/
        "..",
        ".",
        str(run_dir / "snapshots"),  # the folder itself
        str(run_dir / "snapshots" / "link.safetensors"),  # a link in snapshots/ to a file elsewhere
        str(run_dir / "snapshots" / "up" / theirs.name),  # through a link to a folder elsewhere
        "/etc/passwd",
        "a/b",
    ]
    sender = WeightSender(secret=SECRET)
    try:
        with RedisBus(bus_settings) as bus:
            gate = AnnouncementGate(bus, SECRET, run_dir)

            def through_redis(snapshot_path: str) -> WeightAnnouncement:
                announcement = sender.announce(
                    {"w": torch.arange(3.0)}, version=2, epoch=1, members=[], snapshot_path=snapshot_path
                )
                announcement = sign_announcement(announcement, SECRET)
                bus.set_value(ANNOUNCEMENT_KEY, announcement.model_dump_json())
                sender.published(announcement)
                read = gate.latest()
                assert read == announcement
                return read

            for path in paths:
                announcement = through_redis(path)
                assert gate.local_snapshot(announcement) is None, path
                assert catch_up(VersionInstaller(NoEngine(), "."), announcement, gate, SECRET) is None  # type: ignore[arg-type]
            assert gate.local_snapshot(through_redis(str(ours))) == ours.resolve()
    finally:
        sender.close()


# ── sparkrl eval RUN_DIR ──────────────────────────────────────────────────────────────────────────────


def _model_at(folder: Path) -> Path:
    (folder / "hf").mkdir(parents=True)
    (folder / "hf" / "config.json").write_text("{}")
    return folder / "hf"


@pytest.mark.parametrize(
    "latest",
    ["..", ".", "../../elsewhere", "ABS", "a/b", "step-000002/..", "", ".hidden", "link-out", "link-abs"],
)
@pytest.mark.parametrize("as_link", [False, True], ids=["file", "link"])
def test_eval_follows_latest_only_inside_checkpoints(latest: str, as_link: bool, tmp_path: Path) -> None:
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    inside = _model_at(checkpoints / "step-000002")
    elsewhere = _model_at(tmp_path / "elsewhere")
    _model_at(checkpoints)  # what `.` would name
    _model_at(checkpoints / "a" / "b")  # what `a/b` would name
    _model_at(checkpoints / ".hidden")
    (checkpoints / "link-out").symlink_to(elsewhere.parent, target_is_directory=True)  # planted
    (checkpoints / "link-abs").symlink_to(Path("/"), target_is_directory=True)
    name = str(elsewhere.parent) if latest == "ABS" else latest
    marker = checkpoints / "latest"
    if as_link:
        marker.symlink_to(name or ".", target_is_directory=True)
    else:
        marker.write_text(name + "\n")
    with pytest.raises(FileNotFoundError, match="inside checkpoints/"):
        resolve_model(run)
    marker.unlink()
    marker.symlink_to("step-000002", target_is_directory=True)
    assert resolve_model(run) == inside


# ── the control service's static files ────────────────────────────────────────────────────────────────


def test_the_control_page_static_files_stay_in_their_folder(bus_settings: BusSettings) -> None:
    with Server(create_app(ControlSettings(token="t0ken"), bus_settings)) as server:
        status, answer = raw_get(server.port, "/static/app.js")
        assert status == 200
        for target in [
            "/static/../app.py",
            "/static/../routes.py",
            "/static/%2e%2e/app.py",
            "/static/..%2fapp.py",
            "/static/%2e%2e%2fapp.py",
            "/static/..%5capp.py",
            "/static//etc/passwd",
            "/static/%2fetc%2fpasswd",
            "/static/../../../../../../etc/passwd",
            "/static/.",
            "/static/..",
        ]:
            status, answer = raw_get(server.port, target)
            assert status in (400, 404, 405), (target, answer[:300])
            assert b"create_app" not in answer and b"root:" not in answer and b"APIRouter" not in answer
