"""Weights over HTTP for a worker that cannot see the learner's disk (a container, a pod, another host).

The learner serves, on `sync.host`:`sync.http_port`:

- `GET /snapshot` — the latest weight snapshot (safetensors, the file the announcement names);
- `GET /model` — the listing of its model directory (config, tokenizer, weights: name → bytes, sha256);
- `GET /model/NAME` — one of those files; `GET /healthz`.

What a worker trusts comes from the signed announcement, not from this server: a snapshot must match the
announcement's weights checksum, and the model listing the announcement's `model_sha256`, each file its
listed sha256. With a shared secret every request carries a bearer token derived from it (weights are
not for anyone who reaches the port). Files are streamed, never read whole into the server's memory.

No name from the wire names a path: the server serves only the names it listed (each one plain component,
`proto/names.py`; a file of another name is left out of the listing), and a worker writes a listed name
only as one plain component that resolves directly inside its destination folder (a listing from a forged
announcement, or a link planted there, makes it refuse: FetchFailed, nothing written).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import shutil
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from sparkrl.proto.names import safe_name
from sparkrl.services.common.thread_server import (
    CONNECTION_TIMEOUT_S,
    BoundedHandler,
    BoundedServer,
    serve,
    stop,
)

log = logging.getLogger("sparkrl.weight_sync")

CHUNK = 1 << 20


def files_token(secret: str | None) -> str | None:
    """The bearer token of the weight-file routes: derived from the run's secret, never the secret."""
    if secret is None:
        return None
    return hmac.new(secret.encode(), b"sparkrl weight files", hashlib.sha256).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def model_listing(model_dir: Path) -> dict[str, dict[str, Any]]:
    """name → {bytes, sha256} of every regular file in the model directory (one level) whose name is one
    plain component (proto/names.py: no hidden file); a file of another name is left out, with a warning,
    since no worker would write it. Links are followed: the directory is the operator's (a Hugging Face
    cache's snapshot is links to its blobs)."""
    listing = {}
    for p in sorted(model_dir.iterdir()):
        if not p.is_file() or p.name.startswith("."):
            continue
        try:
            safe_name(p.name)
        except ValueError as exc:
            log.warning("%s is not served to workers: %s", p, exc)
            continue
        listing[p.name] = {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
    return listing


def listing_sha256(listing: dict[str, dict[str, Any]]) -> str:
    """The digest the announcement carries for the listing (canonical JSON)."""
    return hashlib.sha256(json.dumps(listing, sort_keys=True).encode()).hexdigest()


class WeightFileServer:
    """`start()` binds host:port (port 0: any free one; `url` once bound); `close()` stops it."""

    def __init__(
        self,
        host: str,
        port: int,
        model_dir: Path,
        snapshot: Path,
        secret: str | None,
        connection_timeout_s: float = CONNECTION_TIMEOUT_S,
    ) -> None:
        """`connection_timeout_s`: a request's head arrives within it, and no read or write (a chunk of a
        download) waits longer for the peer."""
        self.host, self.requested_port = host, port
        self.connection_timeout_s = connection_timeout_s
        self.model_dir, self.snapshot = model_dir, snapshot
        # Hashing a real model's files takes a while: on a thread; announced once known (None before).
        self.listing: dict[str, dict[str, Any]] | None = None
        self.model_sha256: str | None = None
        self._listed = threading.Event()
        self._token = files_token(secret)
        self._server: BoundedServer | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        address = (self.host, self.requested_port)
        self._server = BoundedServer(address, _handler_for(self), self.connection_timeout_s)
        self.port = self._server.server_address[1]
        serve(self._server, "weight-files")
        threading.Thread(target=self._list_model, name="model-listing", daemon=True).start()
        log.info("weight files for late joiners on %s (/snapshot, /model)", self.url)

    def _list_model(self) -> None:
        try:
            listing = model_listing(self.model_dir)  # the model directory does not change during a run
            self.listing, self.model_sha256 = listing, listing_sha256(listing)
        finally:
            self._listed.set()

    def wait_listed(self, timeout_s: float | None = None) -> bool:
        """Until the model listing is known (so the first announcement carries its digest)."""
        return self._listed.wait(timeout_s)

    def close(self) -> None:
        if self._server is not None:
            stop(self._server)
            self._server = None

    def authorized(self, header: str | None) -> bool:
        if self._token is None:
            return True
        return header is not None and hmac.compare_digest(header, f"Bearer {self._token}")


def _handler_for(server: WeightFileServer) -> type[BoundedHandler]:
    class Handler(BoundedHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                return self._json(200, {"status": "ok"})
            if not server.authorized(self.headers.get("Authorization")):
                return self._json(401, {"detail": "missing or wrong bearer token (derived from sync.secret)"})
            if path == "/snapshot":
                return self._file(server.snapshot, "no snapshot written yet")
            listing = server.listing
            if path.startswith("/model") and listing is None:
                return self._json(503, {"detail": "still hashing the model directory; try again shortly"})
            if path == "/model":
                return self._json(200, {"files": listing, "sha256": server.model_sha256})
            name = path.removeprefix("/model/")
            if path.startswith("/model/") and listing is not None and name in listing:
                return self._file(server.model_dir / name, f"{name} is gone from the model directory")
            self._json(404, {"detail": "not found: try /snapshot, /model, /model/NAME or /healthz"})

        def _file(self, path: Path, missing: str) -> None:
            try:
                file = path.open("rb")  # a snapshot replaced meanwhile (os.replace) is read whole as it was
            except FileNotFoundError:
                return self._json(404, {"detail": missing})
            with file:
                size = os.fstat(file.fileno()).st_size  # of the file opened, not of a newer one
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                shutil.copyfileobj(file, self.wfile, CHUNK)

        def _json(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    return Handler


# ── the worker's side ─────────────────────────────────────────────────────────────────────────────────


class FetchFailed(OSError):
    """A download from the learner failed or did not verify; the message says which and why."""


def _get(url: str, secret: str | None, timeout_s: float) -> Any:
    request = urllib.request.Request(url)
    token = files_token(secret)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        return urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        raise FetchFailed(f"GET {url}: HTTP {exc.code} {exc.read()[:200].decode(errors='replace')}") from exc
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise FetchFailed(f"GET {url}: {exc}") from exc


def fetch_bytes(url: str, secret: str | None, timeout_s: float = 600.0) -> bytes:
    with _get(url, secret, timeout_s) as response:
        return response.read()


def fetch_model(base_url: str, expected_sha256: str, dest: Path, secret: str | None) -> Path:
    """Download the learner's model directory into `dest` (kept when already complete and verified);
    every file is checked against the listing, the listing against the announcement's digest."""
    with _get(f"{base_url}/model", secret, 60.0) as response:
        body = json.loads(response.read())
    listing = body.get("files", {})
    if listing_sha256(listing) != expected_sha256:
        raise FetchFailed(f"{base_url}/model: the listing does not match the announcement's model_sha256")
    dest.mkdir(parents=True, exist_ok=True)
    # Every name is checked before the first write: a listing with one bad name leaves nothing behind.
    targets = {name: _download_target(dest, name, f"{base_url}/model") for name in listing}
    for name, meta in listing.items():
        target = targets[name]
        if target.is_file() and file_sha256(target) == meta["sha256"]:
            continue
        with tempfile.NamedTemporaryFile(dir=dest, prefix=f".{name}.", delete=False) as tmp:
            with _get(f"{base_url}/model/{name}", secret, 600.0) as response:
                shutil.copyfileobj(response, tmp, CHUNK)
        got = file_sha256(Path(tmp.name))
        if got != meta["sha256"]:
            Path(tmp.name).unlink(missing_ok=True)
            raise FetchFailed(f"{base_url}/model/{name}: sha256 {got} is not the listed {meta['sha256']}")
        Path(tmp.name).replace(target)
        log.info("fetched %s (%d bytes) from the learner", name, meta["bytes"])
    return dest


def _download_target(dest: Path, name: str, url: str) -> Path:
    """`dest / name`, once `name` is one plain component and the path resolves directly inside `dest` (a
    link planted there is refused, never followed or replaced); FetchFailed otherwise, before any write."""
    try:
        safe_name(name)
    except ValueError as exc:
        raise FetchFailed(f"{url} lists an unsafe file name: {exc}") from exc
    target = dest / name
    if target.resolve().parent != dest.resolve():
        raise FetchFailed(
            f"{target} resolves to {target.resolve()}, outside {dest}: refused (remove it, the worker "
            "fetches the file again)"
        )
    return target
